"""The routes: completions and chat (POST /v1/...), models, and the operational ones (health,
readiness, vLLM's /ping and /load, metrics, version)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.inputs.images import PreparedImage, expand_image_tokens
from engine.params import ParamError, ResolvedParams
from server.chat import chat_inputs, output_parser
from server.errors import APIError, draining_error, queue_full_error, to_api_error
from server.media import ImageRef
from server.parsers import OutputParser
from server.protocol import (
    ChatCompletionRequest,
    CommonParams,
    CompletionRequest,
    schema_param,
)
from server.render import ChatRenderer, CompletionRenderer, Renderer
from server.run import Prompt, RequestRun, SSEResponse
from server.state import ServerState

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


def ops_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        stats = state.engine.stats
        body = {"status": "ok" if stats.healthy else "unhealthy"}
        if stats.failure:  # the engine stopped for good: the process exits (`server.serve`)
            body["reason"] = stats.failure
        return JSONResponse(body, status_code=200 if stats.healthy else 503)

    def is_ready() -> bool:
        stats = state.engine.stats
        return state.ready and not state.draining and stats.alive and not stats.warming_up

    @router.get("/ready")
    async def ready() -> Response:
        """200 once the server takes requests; 503 while it loads, while the engine warms up
        (compiling its kernels: requests sent meanwhile wait for it) and while it drains."""
        ok, warming = is_ready(), state.engine.stats.warming_up
        status = "ready" if ok else "draining" if state.draining else "loading"
        status = "warming up" if warming and status == "loading" else status
        return JSONResponse({"status": status}, status_code=200 if ok else 503)

    @router.get("/ping")
    @router.post("/ping")
    async def ping() -> Response:
        """SageMaker's health check, as vLLM serves it: an empty 200 while the server takes
        requests (as /ready), else an empty 503, so a draining server leaves the rotation."""
        return Response(status_code=200 if is_ready() else 503)

    @router.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: the engine requests in flight, those admitted whose engine
        generator has not started yet included (a request with n choices counts n)."""
        num = max(state.admission.num_admitted, state.engine.stats.num_inflight)
        return {"server_load": num}

    @router.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render(state.engine.stats)
        return Response(body, media_type="text/plain; version=0.0.4")

    @router.get("/version")
    async def version() -> dict[str, Any]:
        limits = state.engine.limits
        return {
            "version": VERSION,
            "numerics": limits.numerics,
            "kernels": limits.kernels,
            "prefix_caching": limits.prefix_caching,
        }

    return router


def admin_router(state: ServerState) -> APIRouter:
    """Operator routes that change the engine (they need the API key when one is set)."""
    router = APIRouter()

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's route: forget every cached prefix page (running requests keep theirs)."""
        try:
            forgotten = await state.engine.reset_prefix_cache()
        except RuntimeError as exc:
            raise APIError(503, f"cannot reset the prefix cache: {exc}") from None
        return JSONResponse({"status": "ok", "pages_forgotten": forgotten})

    return router


def v1_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "canvas"}
            for name in state.served_names
        ]
        return {"object": "list", "data": cards}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        renderer = CompletionRenderer(
            request.state.response_key, state.response_name(body.model), body.include_usage
        )
        with param_errors(renderer):
            prompts = body.prompts()
            limit = body.max_tokens
            max_tokens = limit if limit is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        tokenizer = state.tokenizer
        if tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise APIError(
                400, "This model has no tokenizer; send the prompt as token ids", "prompt"
            )

        def encode() -> list[list[int]]:
            return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]  # type: ignore[union-attr]

        return await _serve(state, body, encode, max_tokens, renderer, request)

    @router.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        renderer = ChatRenderer(
            request.state.response_key,
            state.response_name(body.model),
            body.include_usage,
            state.reasoning_field,
        )
        return await serve_chat(state, body, renderer, request)

    return router


async def serve_chat(
    state: ServerState, body: ChatCompletionRequest, renderer: ChatRenderer, request: Request
) -> Response:
    """Serve a chat request with `renderer`'s bodies (chat completions, or another API built
    on the chat path: `server.responses`): the full response, or an `SSEResponse`."""
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "This model has no tokenizer, so it has no chat template", "messages")
    with param_errors(renderer):
        inputs = chat_inputs(body, tokenizer)
        max_tokens = body.token_limit  # None: the checkpoint's default, bounded by the room
    if inputs.images:  # the cheap refusals first (as `_serve` orders them), then the work
        if state.draining:
            raise draining_error()
        _check_served(state, body)
    images = await prepare_images(state, inputs.images)

    def encode() -> list[list[int]]:
        ids = tokenizer.apply_chat_template(inputs.messages, inputs.tools, inputs.template_kwargs)
        return [with_image_tokens(state, ids, images)]

    parser = output_parser(body)
    return await _serve(state, body, encode, max_tokens, renderer, request, parser, images)


async def prepare_images(state: ServerState, refs: list[ImageRef]) -> tuple[PreparedImage, ...]:
    """The images of a request's image parts (fetched, decoded and preprocessed off the event
    loop); 400 naming the part when the checkpoint takes no images or a part is refused."""
    if not refs:
        return ()
    if state.media is None:
        raise APIError(
            400,
            "image input is not supported by this model (its checkpoint has no vision tower "
            "or no image processor config)",
            refs[0].param,
        )
    try:
        return tuple(await state.media.prepare(refs))
    except ParamError as exc:
        raise APIError(400, str(exc), exc.param) from None


def with_image_tokens(
    state: ServerState, ids: list[int], images: tuple[PreparedImage, ...]
) -> list[int]:
    """The rendered conversation's ids with each image placeholder expanded to its image's
    tokens (`engine.inputs.images.expand_image_tokens`); ids as they are without images."""
    if not images:
        return ids
    assert state.media is not None, "images are prepared only with image input on"
    return expand_image_tokens(ids, list(images), state.media.processor.vision)


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
    check_model(state, body.model)


def check_model(state: ServerState, model: str | None) -> None:
    """404 unless `model` (None: not given) is one of the served names."""
    if model is not None and model not in state.served_names:
        served = ", ".join(f"'{name}'" for name in state.served_names)
        raise APIError(
            404,
            f"The model {_shown(model)} does not exist; this server serves {served}",
            "model",
            "model_not_found",
        )


async def _serve(
    state: ServerState,
    body: CommonParams,
    encode: Callable[[], list[list[int]]],
    max_tokens: int | None,
    renderer: Renderer,
    request: Request,
    parser: Callable[[], OutputParser] | None = None,
    images: tuple[PreparedImage, ...] = (),
) -> Response:
    """Check the cheap things first (503 draining, 400/404 parameters and model), tokenise off
    the event loop (`encode`: the prompts, or the chat template), check each prompt's context
    (400), admit the request's choices (429 when full), wait until the engine has accepted
    them (what it refuses is a status: 429, 400, 500), and only then start the response."""
    if state.draining:
        raise draining_error()
    _check_served(state, body)
    with param_errors(renderer):
        sampling = body.sampling_params(max_tokens)
    prompt_ids = await _tokenize(encode, renderer)
    num_requests = len(prompt_ids) * body.n
    if num_requests > state.admission.capacity:
        raise APIError(
            400,
            f"{len(prompt_ids)} prompts × n={body.n} are {num_requests} generations, more than "
            f"the {state.admission.capacity} this server runs at once; split the request",
            "prompt" if len(prompt_ids) > 1 else "n",
        )
    prompts = []
    for i, ids in enumerate(prompt_ids):
        with _prompt_errors(renderer, i if len(prompt_ids) > 1 else None):
            prompts.append(Prompt(ids, state.validator.validate(ids, sampling), images))
    await _prepare(state, body, prompts[0].params, renderer)
    ticket = state.admission.admit(num_requests, state.engine.stats.num_inflight)
    if ticket is None:
        raise queue_full_error()
    logger.info(
        "request %s: %d prompt tokens in %d prompts, n=%d, stream=%s",
        renderer.response_id,
        sum(len(ids) for ids in prompt_ids),
        len(prompt_ids),
        body.n,
        body.stream,
    )
    want_drafts = body.stream and body.stream_drafts
    renderer.continuous_usage = body.continuous_usage
    run = RequestRun(
        state,
        renderer,
        prompts,
        body.n,
        body.stop_strings,
        want_drafts,
        parser,
        body.text_options(),
    )
    try:
        await run.open()  # the engine accepted every choice: nothing is refused in-band now
    except Exception as exc:
        ticket.release()
        raise to_api_error(exc, renderer.response_id, renderer.prompt_param) from None
    except BaseException:
        ticket.release()
        raise
    if body.stream:
        return SSEResponse(run, ticket)  # releases the ticket when the stream ends
    try:
        return JSONResponse(await run.complete(request))
    finally:
        await run.close()
        ticket.release()


async def _prepare(
    state: ServerState, body: CommonParams, params: ResolvedParams, renderer: Renderer
) -> None:
    """Compile the request's JSON schema (cached, off the event loop and the step loop), so a
    bad one is a 400 naming the parameter that carried it, before any stream starts."""
    try:
        await state.engine.prepare(params)
    except ParamError as exc:
        error = to_api_error(exc, renderer.response_id, renderer.prompt_param)
        error.param = schema_param(body)
        raise error from None


@contextlib.contextmanager
def _prompt_errors(renderer: Renderer, index: int | None) -> Iterator[None]:
    """A ParamError about prompt `index` of a batch names it (prompt.3)."""
    try:
        yield
    except ParamError as exc:
        error = to_api_error(exc, renderer.response_id, renderer.prompt_param)
        if index is not None and error.param in ("prompt", "messages"):
            error.param = f"prompt.{index}"
            error.message = f"prompt {index}: {error.message}"
        raise error from None


async def _tokenize(encode: Callable[[], list[list[int]]], renderer: Renderer) -> list[list[int]]:
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
