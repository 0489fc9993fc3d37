"""The HTTP server: OpenAI-compatible routes over the async engine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /ready, GET /metrics, GET /version, OpenAPI docs at /docs. With an API key, the /v1 routes
need `Authorization: Bearer <key>`; /health, /ready, /metrics and /docs stay public.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine
from engine.engine import StepOutput
from engine.params import DecodeMode, DecodingDefaults, ParamError, ResolvedParams, SamplingParams
from engine.scheduler import QueueFull
from engine.tokenizer import Tokenizer
from server.errors import (
    APIError,
    api_error_handler,
    context_length_error,
    http_error_handler,
    validation_error_handler,
)
from server.metrics import Metrics
from server.protocol import ChatCompletionRequest, CommonParams, CompletionRequest
from server.text import TextStream

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer | None
    defaults: DecodingDefaults
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    ready: bool = False
    draining: bool = False
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name)


@dataclass(slots=True)
class Choice:
    """One choice of a request as it is produced."""

    index: int
    text: TextStream
    finish_reason: str | None = None
    stats: Any = None


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start(asyncio.get_running_loop())
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            state.engine.shutdown()

    app = FastAPI(
        title="Canvas",
        version=VERSION,
        description="OpenAI-compatible block-diffusion LLM server",
        lifespan=lifespan,
    )
    app.state.canvas = state
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    state.engine.on_step.append(state.metrics.on_step)

    @app.middleware("http")
    async def _edge(request: Request, call_next: Any) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.state.request_id = request_id
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            err = APIError(
                413, f"Request body of {length} bytes exceeds the limit of {state.max_body_bytes}"
            )
            return JSONResponse(err.body(), status_code=413, headers={"x-request-id": request_id})
        if (
            state.api_key
            and request.url.path.startswith("/v1/")
            and not _authorized(request, state.api_key)
        ):
            err = APIError(401, "Invalid or missing API key (send Authorization: Bearer <key>)")
            return JSONResponse(err.body(), status_code=401, headers={"x-request-id": request_id})
        response = await call_next(request)
        response.headers["x-request-id"] = request_id
        return response

    @app.get("/health")
    async def health() -> Response:
        ok = state.engine.is_healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/ready")
    async def ready() -> Response:
        ok = state.ready and not state.draining and state.engine.is_alive()
        status = "ready" if ok else ("draining" if state.draining else "loading")
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        s = state.engine.stats
        body = state.metrics.render(s.num_running, s.num_waiting, s.kv_usage)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict[str, str]:
        kernels = state.engine.engine.model.kernels
        return {"version": VERSION, "numerics": kernels.numerics, "kernels": kernels.backend}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "canvas"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            if state.tokenizer is None:
                raise APIError(
                    400, "This model has no tokenizer; send the prompt as token ids", "prompt"
                )
            prompt_ids = state.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        limit = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        return await _serve(state, body, prompt_ids, limit, "text_completion", request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        if state.tokenizer is None:
            raise APIError(
                400, "This model has no tokenizer, so it has no chat template", "messages"
            )
        try:
            prompt_ids = state.tokenizer.apply_chat_template(body.chat())
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        return await _serve(state, body, prompt_ids, body.token_limit, "chat.completion", request)

    return app


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    return hmac.compare_digest(token.encode(), key.encode())


def _resolve(
    state: ServerState, body: CommonParams, num_prompt: int, max_tokens: int | None
) -> ResolvedParams:
    """Validate and map the request onto engine parameters (400 naming the parameter)."""
    if (name := body.unsupported()) is not None:
        raise APIError(
            400, f"Canvas does not support the parameter '{name}'", name, "unsupported_parameter"
        )
    if body.model != state.model_name:
        raise APIError(
            404,
            f"The model '{body.model}' does not exist; this server serves '{state.model_name}'",
            "model",
            "model_not_found",
        )
    engine = state.engine.engine
    limit = engine.model.cfg.max_position_embeddings
    if max_tokens is None:  # chat default: the checkpoint's, bounded by what fits
        room = (limit - num_prompt) // engine.canvas_length * engine.canvas_length
        max_tokens = max(1, min(state.defaults.max_new_tokens, room))
    mode = DecodeMode(body.mode) if body.mode else state.defaults.mode
    t_min, t_max = body.t_min, body.t_max
    temperature = body.temperature
    if mode is DecodeMode.DIFFUSION and temperature is not None:
        # OpenAI's temperature scales the whole linear schedule (1 = the checkpoint's schedule);
        # 0 is taken as 0.01, i.e. nearly greedy denoising.
        scale = max(temperature, 0.01)
        t_min = (t_min if t_min is not None else state.defaults.t_min) * scale
        t_max = (t_max if t_max is not None else state.defaults.t_max) * scale
        temperature = None
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            mode=mode,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            max_denoising_steps=body.max_denoising_steps,
            entropy_bound=body.entropy_bound,
            t_min=t_min,
            t_max=t_max,
            stability_threshold=body.stability_threshold,
            confidence_threshold=body.confidence_threshold,
            temperature=temperature,
        )
        resolved = state.defaults.resolve(params)
    except ParamError as exc:
        raise APIError(400, str(exc), exc.param) from None
    needed = engine.context_needed(num_prompt, resolved)
    if needed > limit:
        raise context_length_error(limit, num_prompt, needed - num_prompt)
    return resolved


async def _serve(
    state: ServerState,
    body: CommonParams,
    prompt_ids: list[int],
    max_tokens: int | None,
    kind: str,
    request: Request,
) -> Response:
    if state.draining:
        raise APIError(503, "The server is draining", headers={"Retry-After": "5"})
    params = _resolve(state, body, len(prompt_ids), max_tokens)
    try:
        state.engine.engine.check_prompt(prompt_ids)
    except ParamError as exc:
        raise APIError(
            400, str(exc), "prompt" if kind == "text_completion" else "messages"
        ) from None
    if state.engine.num_inflight + body.n > state.engine.max_inflight:
        raise APIError(
            429,
            "Too many requests are waiting; retry later",
            code="queue_full",
            headers={"Retry-After": "1"},
        )
    request_id = request.state.request_id
    prefix = "chatcmpl-" if kind == "chat.completion" else "cmpl-"
    run = _Run(state, body, prompt_ids, params, kind, f"{prefix}{request_id}")
    logger.info(
        "request %s: %d prompt tokens, n=%d, stream=%s",
        request_id,
        len(prompt_ids),
        body.n,
        body.stream,
    )
    if body.stream:
        return StreamingResponse(run.sse(request), media_type="text/event-stream")
    return JSONResponse(await run.complete(request))


class _Run:
    """One HTTP request: its n choices, run concurrently as engine requests."""

    def __init__(
        self,
        state: ServerState,
        body: CommonParams,
        prompt_ids: list[int],
        params: ResolvedParams,
        kind: str,
        response_id: str,
    ) -> None:
        self.state, self.body, self.prompt_ids, self.params = state, body, prompt_ids, params
        self.kind, self.response_id = kind, response_id
        self.created = int(time.time())
        decode = state.tokenizer.decode if state.tokenizer else (lambda ids: "")
        self.choices = [Choice(i, TextStream(decode, body.stop_strings)) for i in range(body.n)]

    def _choice_params(self, index: int) -> ResolvedParams:
        seed = self.params.seed
        if seed is None or index == 0:
            return self.params
        return replace(self.params, seed=(seed + index) % 2**63)

    async def _run_choice(self, choice: Choice, sink: asyncio.Queue | None) -> None:
        """Drive one engine request; push (choice, text delta, draft) events to `sink`."""
        engine_id = f"{self.response_id}-{choice.index}"
        params = self._choice_params(choice.index)
        last = time.monotonic()
        stream = self.state.engine.generate(
            engine_id, self.prompt_ids, params, self.body.stream_drafts
        )
        try:
            async for out in stream:
                delta = choice.text.add(out.new_token_ids, final=out.finish_reason is not None)
                if choice.text.stopped:
                    choice.finish_reason = "stop"
                elif out.finish_reason is not None:
                    choice.finish_reason = out.finish_reason
                    choice.stats = out.stats
                if out.new_token_ids:
                    now = time.monotonic()
                    self.state.metrics.itl.observe(now - last)
                    last = now
                if sink is not None and (delta or out.draft is not None or choice.finish_reason):
                    draft = self._draft_text(out) if out.draft is not None else None
                    await sink.put((choice, delta, draft))
                if choice.finish_reason is not None:
                    break
        finally:
            await stream.aclose()  # aborts the engine request if it is still running
        self._record(choice)

    def _draft_text(self, out: StepOutput) -> str:
        tokenizer = self.state.tokenizer
        return tokenizer.decode(out.draft) if tokenizer and out.draft is not None else ""

    def _record(self, choice: Choice) -> None:
        metrics = self.state.metrics
        if choice.stats is not None:
            metrics.on_finish(choice.stats, choice.finish_reason or "stop", choice.text.num_tokens)
            if choice.stats.first_token_time is not None:
                metrics.ttft.observe(choice.stats.first_token_time - choice.stats.arrival_time)
        elif choice.finish_reason == "stop":
            metrics.success("stop")
            metrics.prompt_tokens.inc(len(self.prompt_ids))
            metrics.generation_tokens.inc(choice.text.num_tokens)

    def _usage(self) -> dict[str, int]:
        completion = sum(c.text.num_tokens for c in self.choices)
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _canvas_stats(self, choice: Choice) -> dict[str, Any] | None:
        s = choice.stats
        if s is None:
            return None
        return {
            "steps_per_canvas": list(s.steps_per_canvas),
            "decoder_passes": s.decoder_passes,
            "tokens_per_forward": s.tokens_per_forward,
        }

    async def _watch(self, request: Request, tasks: list[asyncio.Task]) -> None:
        """Cancel the choices when the client goes away (frees their pages)."""
        while not all(t.done() for t in tasks):
            if await request.is_disconnected():
                logger.info("request %s: client disconnected, aborting", self.response_id)
                for t in tasks:
                    t.cancel()
                return
            await asyncio.sleep(0.25)

    async def complete(self, request: Request) -> dict[str, Any]:
        tasks = [asyncio.create_task(self._run_choice(c, None)) for c in self.choices]
        watcher = asyncio.create_task(self._watch(request, tasks))
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            raise
        except QueueFull:
            raise APIError(
                429,
                "Too many requests are waiting; retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ParamError as exc:
            raise APIError(400, str(exc), exc.param) from None
        except RuntimeError as exc:
            raise APIError(500, f"Engine error for request {self.response_id}: {exc}") from None
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
        return self._response()

    def _response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            item: dict[str, Any] = {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": None,
            }
            if self.kind == "chat.completion":
                item["message"] = {"role": "assistant", "content": c.text.text}
            else:
                item["text"] = c.text.text
            item["canvas_stats"] = self._canvas_stats(c)
            choices.append(item)
        return {
            "id": self.response_id,
            "object": self.kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": self._usage(),
        }

    def _chunk(self, choice: Choice, delta: str, draft: str | None, first: bool) -> dict[str, Any]:
        item: dict[str, Any] = {
            "index": choice.index,
            "finish_reason": choice.finish_reason,
            "logprobs": None,
        }
        if self.kind == "chat.completion":
            d: dict[str, Any] = {"content": delta} if delta or first else {}
            if first:
                d["role"] = "assistant"
            item["delta"] = d
        else:
            item["text"] = delta
        if draft is not None:
            item["draft"] = draft  # an argmax preview of the unfinished canvas; not content
        if choice.finish_reason is not None:
            item["canvas_stats"] = self._canvas_stats(choice)
        obj = "chat.completion.chunk" if self.kind == "chat.completion" else "text_completion"
        chunk = {
            "id": self.response_id,
            "object": obj,
            "created": self.created,
            "model": self.state.model_name,
            "choices": [item],
        }
        if self.body.include_usage:
            chunk["usage"] = None
        return chunk

    async def sse(self, request: Request) -> AsyncIterator[str]:
        sink: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._run_choice(c, sink)) for c in self.choices]
        try:
            if self.kind == "chat.completion":  # the role arrives first, as OpenAI sends it
                for c in self.choices:
                    yield _sse(self._chunk(c, "", None, first=True))
            pending = set(tasks)
            while pending:
                getter = asyncio.create_task(sink.get())
                done, _ = await asyncio.wait(
                    pending | {getter}, return_when=asyncio.FIRST_COMPLETED
                )
                if getter in done:
                    choice, delta, draft = getter.result()
                    yield _sse(self._chunk(choice, delta, draft, first=False))
                else:
                    getter.cancel()
                for t in done - {getter}:
                    pending.discard(t)
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            while not sink.empty():
                choice, delta, draft = sink.get_nowait()
                yield _sse(self._chunk(choice, delta, draft, first=False))
            if self.body.include_usage:
                usage = {
                    "id": self.response_id,
                    "object": "chat.completion.chunk"
                    if self.kind == "chat.completion"
                    else "text_completion",
                    "created": self.created,
                    "model": self.state.model_name,
                    "choices": [],
                    "usage": self._usage(),
                }
                yield _sse(usage)
        except (QueueFull, ParamError, RuntimeError) as exc:
            status = (
                429 if isinstance(exc, QueueFull) else 400 if isinstance(exc, ParamError) else 500
            )
            err = APIError(status, str(exc))
            yield _sse(err.body())
        finally:
            for t in tasks:
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
        yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
