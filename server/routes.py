"""The routes: completions and chat (POST /v1/...), models, and the operational ones (health,
readiness, metrics, version)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.params import ParamError
from server.errors import APIError, draining_error, queue_full_error, to_api_error
from server.protocol import ChatCompletionRequest, CommonParams, CompletionRequest
from server.render import ChatRenderer, CompletionRenderer, Renderer
from server.run import RequestRun, SSEResponse
from server.state import ServerState

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


def ops_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        ok = state.engine.stats.healthy
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @router.get("/ready")
    async def ready() -> Response:
        ok = state.ready and not state.draining and state.engine.stats.alive
        status = "ready" if ok else ("draining" if state.draining else "loading")
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render(state.engine.stats)
        return Response(body, media_type="text/plain; version=0.0.4")

    @router.get("/version")
    async def version() -> dict[str, str]:
        limits = state.engine.limits
        return {"version": VERSION, "numerics": limits.numerics, "kernels": limits.kernels}

    return router


def v1_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "canvas"}
        return {"object": "list", "data": [card]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        renderer = CompletionRenderer(
            request.state.response_key, state.model_name, body.include_usage
        )
        with param_errors(renderer):
            prompt = body.single_prompt()
            limit = body.max_tokens
            max_tokens = limit if limit is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        if isinstance(prompt, list):
            return await _serve(state, body, lambda: list(prompt), max_tokens, renderer, request)
        tokenizer = state.tokenizer
        if tokenizer is None:
            raise APIError(
                400, "This model has no tokenizer; send the prompt as token ids", "prompt"
            )
        return await _serve(
            state, body, lambda: tokenizer.encode(prompt), max_tokens, renderer, request
        )

    @router.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        renderer = ChatRenderer(request.state.response_key, state.model_name, body.include_usage)
        tokenizer = state.tokenizer
        if tokenizer is None:
            raise APIError(
                400, "This model has no tokenizer, so it has no chat template", "messages"
            )
        with param_errors(renderer):
            messages = body.chat()
            max_tokens = body.token_limit  # None: the checkpoint's default, bounded by the room
        return await _serve(
            state,
            body,
            lambda: tokenizer.apply_chat_template(messages),
            max_tokens,
            renderer,
            request,
        )

    return router


@contextlib.contextmanager
def param_errors(renderer: Renderer) -> Iterator[None]:
    """Turn a ParamError raised inside the block into its 400."""
    try:
        yield
    except ParamError as exc:
        raise to_api_error(exc, renderer.response_id, renderer.prompt_param) from None


def _check_served(state: ServerState, body: CommonParams) -> None:
    if (name := body.unsupported()) is not None:
        raise APIError(
            400, f"Canvas does not support the parameter '{name}'", name, "unsupported_parameter"
        )
    if body.model != state.model_name:
        raise APIError(
            404,
            f"The model {_shown(body.model)} does not exist; this server serves "
            f"'{state.model_name}'",
            "model",
            "model_not_found",
        )


async def _serve(
    state: ServerState,
    body: CommonParams,
    encode: Callable[[], list[int]],
    max_tokens: int | None,
    renderer: Renderer,
    request: Request,
) -> Response:
    """Check the cheap things first (503 draining, 400/404 parameters and model), tokenise off
    the event loop (`encode`: prompt or chat template), check the context (400), admit the
    request (429 when full, before any response starts), then run it."""
    if state.draining:
        raise draining_error()
    _check_served(state, body)
    with param_errors(renderer):
        sampling = body.sampling_params(max_tokens)
    prompt_ids = await _tokenize(encode, renderer)
    with param_errors(renderer):
        params = state.validator.validate(prompt_ids, sampling)
    ticket = state.admission.admit(body.n, state.engine.stats.num_inflight)
    if ticket is None:
        raise queue_full_error()
    logger.info(
        "request %s: %d prompt tokens, n=%d, stream=%s",
        renderer.response_id,
        len(prompt_ids),
        body.n,
        body.stream,
    )
    want_drafts = body.stream and body.stream_drafts
    run = RequestRun(state, renderer, prompt_ids, params, body.n, body.stop_strings, want_drafts)
    if body.stream:
        return SSEResponse(run, ticket)  # releases the ticket when the stream ends
    try:
        return JSONResponse(await run.complete(request))
    finally:
        ticket.release()


async def _tokenize(encode: Callable[[], list[int]], renderer: Renderer) -> list[int]:
    """Run the tokenizer or chat template in a worker thread: a long prompt must not stall
    the event loop (health probes, other streams)."""
    try:
        return await asyncio.to_thread(encode)
    except ParamError as exc:
        raise to_api_error(exc, renderer.response_id, renderer.prompt_param) from None
    except ValueError as exc:  # the chat template refused the conversation
        raise APIError(400, str(exc), renderer.prompt_param) from None


def _shown(text: str, limit: int = 64) -> str:
    """A client's string fit to echo: its repr (control characters escaped), at most `limit`
    characters."""
    return repr(text if len(text) <= limit else text[:limit] + "…")
