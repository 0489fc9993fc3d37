"""One OpenAI-protocol request, timed: the body it sends and the `RequestRecord` it yields.

Streaming requests read the SSE stream chunk by chunk: the first chunk with content gives the
time to first token, the gaps between content chunks the time per canvas (Canvas sends one
chunk per committed canvas), the final chunk of the choice its `canvas_stats`, and the usage
chunk (`stream_options.include_usage`) the token counts. Any failure — an HTTP status, an
in-band error, a broken connection, the timeout — becomes the record's `error`; nothing raises.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.load.prompts import Prompt
from loadtest.load.stats import RequestRecord, gaps

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """How every request of a run is made. Canvas extras (`ignore_eos`, `mode`,
    `max_denoising_steps`, `confidence_threshold`) are sent only when set, so the generator
    also drives servers that reject unknown fields."""

    endpoint: str = "chat"
    max_tokens: int = 128
    stream: bool = True
    ignore_eos: bool = False
    mode: str | None = None
    max_denoising_steps: int | None = None
    confidence_threshold: float | None = None
    temperature: float | None = None
    request_seed: int | None = None  # request i sends seed request_seed + i
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.timeout_s <= 0:
            raise ValueError(f"the request timeout must be > 0, got {self.timeout_s}")

    def body(self, model: str, prompt: Prompt, index: int) -> dict[str, Any]:
        """The JSON body of request `index` for `prompt`."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens}
        if self.endpoint == "chat":
            body["messages"] = prompt.chat_messages()
        else:
            body["prompt"] = prompt.text
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        optional = {
            "mode": self.mode,
            "max_denoising_steps": self.max_denoising_steps,
            "confidence_threshold": self.confidence_threshold,
            "temperature": self.temperature,
            "seed": None if self.request_seed is None else self.request_seed + index,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclass(slots=True)
class _Progress:
    """What has arrived so far (mutable while the response streams in)."""

    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    spec: RequestSpec,
    model: str,
    prompt: Prompt,
    index: int,
    run_start: float,
) -> RequestRecord:
    """Send request `index` and time it; `run_start` is the run's perf_counter origin."""
    sent = time.perf_counter()
    progress = _Progress()
    error: str | None = None
    try:
        body = spec.body(model, prompt, index)
        call = _stream if spec.stream else _complete
        await asyncio.wait_for(
            call(client, url + ENDPOINTS[spec.endpoint], body, sent, progress), spec.timeout_s
        )
    except asyncio.TimeoutError:
        error = f"timeout after {spec.timeout_s:g} s"
    except _ServerError as exc:
        error = str(exc)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    latency = time.perf_counter() - sent
    stats = progress.stats or {}
    return RequestRecord(
        index=index,
        prompt_name=prompt.name,
        start=sent - run_start,
        latency=latency,
        ttft=progress.ttft,
        canvas_seconds=gaps(progress.chunk_times),
        prompt_tokens=progress.prompt_tokens,
        output_tokens=progress.output_tokens,
        finish_reason=progress.finish_reason,
        steps_per_canvas=tuple(int(s) for s in stats.get("steps_per_canvas") or ()),
        decoder_passes=stats.get("decoder_passes"),
        tokens_per_forward=stats.get("tokens_per_forward"),
        error=error,
    )


class _ServerError(Exception):
    """The server answered with an error (status or in-band)."""


def _error_message(payload: Any, status: int | None = None) -> str:
    message = payload
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        message = payload["error"].get("message", payload["error"])
    prefix = f"HTTP {status}: " if status is not None else "stream error: "
    return prefix + str(message)[:300]


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], sent: float, progress: _Progress
) -> None:
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raw = await response.aread()
            raise _ServerError(_error_message(_json_or_text(raw), response.status_code))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and ": keep-alive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise _ServerError(_error_message(chunk))
            _absorb_chunk(chunk, time.perf_counter() - sent, progress)
    raise _ServerError("stream error: the stream ended without [DONE]")


def _absorb_chunk(chunk: dict[str, Any], now: float, progress: _Progress) -> None:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content") if "delta" in choice else choice.get("text")
        if content:
            if progress.ttft is None:
                progress.ttft = now
            progress.chunk_times.append(now)
        if choice.get("finish_reason") is not None:
            progress.finish_reason = choice["finish_reason"]
        if choice.get("canvas_stats") is not None:
            progress.stats = choice["canvas_stats"]
    usage = chunk.get("usage")
    if usage:
        progress.prompt_tokens = usage.get("prompt_tokens")
        progress.output_tokens = int(usage.get("completion_tokens") or 0)


async def _complete(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], sent: float, progress: _Progress
) -> None:
    response = await client.post(url, json=body)
    payload = _json_or_text(response.content)
    if response.status_code != 200:
        raise _ServerError(_error_message(payload, response.status_code))
    (choice,) = payload["choices"][:1]
    progress.ttft = time.perf_counter() - sent  # the whole answer arrives at once
    progress.finish_reason = choice.get("finish_reason")
    progress.stats = choice.get("canvas_stats")
    usage = payload.get("usage") or {}
    progress.prompt_tokens = usage.get("prompt_tokens")
    progress.output_tokens = int(usage.get("completion_tokens") or 0)


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
