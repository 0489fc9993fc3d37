"""POST /tokenize and /detokenize in vLLM's shapes.

/tokenize takes a `prompt` (text, encoded as /v1/completions encodes it; `add_special_tokens`
false leaves out BOS) or chat `messages` (rendered by the chat template as /v1/chat/completions
renders them, with `tools`, `chat_template_kwargs` and `add_generation_prompt`; each image part
counted as its image's tokens, so its image is fetched and preprocessed) and answers
{"count", "max_model_len", "tokens"}; /detokenize takes `tokens` and answers {"prompt"}.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from engine.inputs.images import PreparedImage
from engine.params import ParamError
from server.chat import ChatInputs, chat_inputs
from server.errors import APIError
from server.protocol import Bool, ChatCompletionRequest, ChatMessage, Int, ToolDef, check_text
from server.routes import check_model, prepare_images, with_image_tokens
from server.state import ServerState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: Bool = True
    # vLLM's defaults: True for a prompt; a chat template writes its own special tokens.
    add_special_tokens: Bool | None = None
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Int]


def tokenize_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(state, body.model)
        images = await _images(state, body)
        tokens = await asyncio.to_thread(_encode, state, body, images)
        limit = state.engine.limits.max_context_positions
        return {"count": len(tokens), "max_model_len": limit, "tokens": tokens}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(state, body.model)
        tokenizer = _tokenizer(state, "tokens")
        vocab_size = state.engine.limits.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab_size:
                raise APIError(
                    400,
                    f"tokens: token id {token} at position {i} is not in the vocabulary "
                    f"[0, {vocab_size})",
                    "tokens",
                )
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    return router


def _tokenizer(state: ServerState, param: str) -> Any:
    if state.tokenizer is None:
        raise APIError(400, "This model has no tokenizer", param)
    return state.tokenizer


async def _images(state: ServerState, body: TokenizeRequest) -> tuple[PreparedImage, ...]:
    """The images of the messages' image parts (none when the body is one `_encode` refuses:
    it reports that, in its own order)."""
    if body.messages is None or body.prompt is not None or body.add_special_tokens:
        return ()
    if state.tokenizer is None:
        return ()
    try:
        refs = _chat_inputs(state, body).images
    except APIError:
        return ()
    return await prepare_images(state, refs)


def _chat_inputs(state: ServerState, body: TokenizeRequest) -> ChatInputs:
    """The template inputs of `body.messages`; 400 naming the parameter."""
    chat = ChatCompletionRequest(
        model=state.model_name,
        messages=body.messages or [],
        tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    try:
        return chat_inputs(chat, _tokenizer(state, "messages"))
    except ParamError as exc:
        raise APIError(400, str(exc), exc.param) from None


def _encode(
    state: ServerState, body: TokenizeRequest, images: tuple[PreparedImage, ...] = ()
) -> list[int]:
    """The ids of the prompt or of the rendered conversation (each image's tokens counted);
    400 naming the parameter."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Send exactly one of 'prompt' and 'messages'", "prompt")
    try:
        if body.prompt is not None:
            if body.tools is not None or body.chat_template_kwargs is not None:
                param = "tools" if body.tools is not None else "chat_template_kwargs"
                raise ParamError(param, "applies to 'messages', not to 'prompt'")
            check_text("prompt", body.prompt)
            add = body.add_special_tokens is not False
            return list(_tokenizer(state, "prompt").encode(body.prompt, add))
        if body.add_special_tokens:
            raise ParamError(
                "add_special_tokens", "must be false with 'messages': the template writes them"
            )
        tokenizer = _tokenizer(state, "messages")
        inputs = _chat_inputs(state, body)
        ids = tokenizer.apply_chat_template(
            inputs.messages, inputs.tools, inputs.template_kwargs, body.add_generation_prompt
        )
        return with_image_tokens(state, list(ids), images)
    except ParamError as exc:
        raise APIError(400, str(exc), exc.param) from None
    except ValueError as exc:  # the chat template refused the conversation
        raise APIError(400, str(exc), "messages") from None
