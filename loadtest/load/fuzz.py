"""Numeric-extreme fuzzing of the HTTP API: no body may make the server answer 5xx or fail a
stream in-band, and none may hurt the ordinary requests after it.

    python -m loadtest.load.fuzz [--requests 100000] [--seed 0] [--concurrency 16]   (make fuzz)

An in-process server on the tiny `c16` checkpoint (`--max-num-seqs 8`) gets `--requests`
bodies, each a valid request with one to four fields set to extremes (0, denormals, huge, ±inf
and NaN spelled as strings, 2^63, wrong types) on both routes, streamed or not; the same seed
gives the same bodies. Counted: statuses, 5xx and in-band stream errors (both must be 0). Then
16 ordinary concurrent requests (all must be 200) and the engine's gauges: no running request,
no KV page and no sampler slot still held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

EXTREMES: list[Any] = [
    0, -0.0, 5e-324, 1e-30, 1e-3, 0.5, 1, 2, 2.0001, 1e4, 1e30, 1e308, -1, -1e308,
    "inf", "-inf", "NaN", "Infinity", "1e999", 2**31, 2**63 - 1, 2**63, 2**64, -(2**63),
    True, None, "x", [], {},
]  # fmt: skip
FIELDS = [
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "n", "logprobs",
    "top_logprobs", "entropy_bound", "t_min", "t_max", "max_denoising_steps",
    "stability_threshold", "confidence_threshold", "presence_penalty", "frequency_penalty",
]  # fmt: skip
MODES = ["diffusion", "ar"]


@dataclass
class FuzzResult:
    requests: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # bodies that got a 5xx
    in_band_errors: list[str] = field(default_factory=list)  # 200 streams that failed inside
    burst_statuses: list[int] = field(default_factory=list)
    held_after: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        held = any(v != 0 for v in self.held_after.values())
        burst_ok = all(s == 200 for s in self.burst_statuses)
        return not self.server_errors and not self.in_band_errors and burst_ok and not held


def body_for(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    """A valid cheap request with one to four fields set to extremes: (route, body)."""
    body: dict[str, Any] = {"model": model, "max_tokens": 4, "max_denoising_steps": 2}
    body["mode"] = rng.choice(MODES)
    if rng.random() < 0.5:
        route = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "hi " * rng.randint(1, 4)}]
    else:
        route = "/v1/completions"
        body["prompt"] = [rng.randint(3, 400) for _ in range(rng.randint(1, 12))]
    body["stream"] = rng.random() < 0.4
    for name in rng.sample(FIELDS, rng.randint(1, 4)):
        body[name] = rng.choice(EXTREMES)
    if route == "/v1/completions" and "logprobs" in body and body["logprobs"] is True:
        body["logprobs"] = 1  # completions take an integer; keep the extremes elsewhere
    return route, body


async def _one(
    client: httpx.AsyncClient, url: str, route: str, body: dict[str, Any]
) -> tuple[int, bool]:
    """(status, failed in-band)."""
    if not body.get("stream"):
        r = await client.post(url + route, json=body)
        return r.status_code, False
    async with client.stream("POST", url + route, json=body) as r:
        text = (await r.aread()).decode("utf-8", "replace")
    in_band = r.status_code == 200 and '"error"' in text
    return r.status_code, in_band


async def fuzz(url: str, model: str, num_requests: int, seed: int, concurrency: int) -> FuzzResult:
    result = FuzzResult()
    rng = random.Random(seed)
    bodies = [body_for(rng, model) for _ in range(num_requests)]
    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=120.0) as client:
            while not queue.empty():
                route, body = queue.get_nowait()
                status, in_band = await _one(client, url, route, body)
                result.requests += 1
                result.statuses[str(status)] += 1
                if status >= 500:
                    result.server_errors.append(json.dumps(body))
                if in_band:
                    result.in_band_errors.append(json.dumps(body))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    async with httpx.AsyncClient(timeout=120.0) as client:
        ordinary = {"model": model, "prompt": [5, 6, 7], "max_tokens": 8}
        burst = await asyncio.gather(
            *(client.post(url + "/v1/completions", json=ordinary) for _ in range(16))
        )
        result.burst_statuses = [r.status_code for r in burst]
        result.held_after = await held_after(client, url)
    return result


HELD = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "canvas:sampler_slots_used")


async def held_after(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """What the engine still holds by its gauges (all 0 when idle and nothing leaked)."""
    metrics = (await client.get(url + "/metrics")).text
    return {name: _gauge(metrics, name) for name in HELD}


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.load.fuzz", description=__doc__)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--serve-flags", default="", help="more `canvas serve` flags, e.g. '--overlap'")
    args = p.parse_args(argv)

    import torch

    from engine.checkpoints.default import cache_dir
    from engine.checkpoints.tiny import make_tiny
    from loadtest.load.inprocess import serve_in_thread

    torch.set_num_threads(2)
    checkpoint = cache_dir() / "tiny-c16"
    if not (checkpoint / "config.json").is_file():
        make_tiny(checkpoint, "c16")
    flags = ["--served-model-name", "tiny", "--max-num-seqs", "8"]
    flags += shlex.split(args.serve_flags)
    with serve_in_thread(checkpoint, flags) as server:
        result = asyncio.run(fuzz(server.url, "tiny", args.requests, args.seed, args.concurrency))
    print(
        f"fuzz seed {args.seed}: {result.requests} requests {dict(result.statuses)}, "
        f"{len(result.server_errors)} 5xx, {len(result.in_band_errors)} in-band errors; "
        f"burst {Counter(result.burst_statuses)}; held after {result.held_after}"
    )
    for body in (result.server_errors + result.in_band_errors)[:10]:
        print("  failing body:", body)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
