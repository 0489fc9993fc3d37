"""POST /v1/responses: OpenAI's Responses API, served on the chat path.

A Responses request is turned into the chat request it means (`chat_request`: instructions and
input items as messages, `server.responses_input`; function tools and `tool_choice` in chat's
shape; `text.format` as `response_format`; `reasoning.effort` as `reasoning_effort`;
`max_output_tokens` as `max_tokens`), served as a chat completion is (`server.routes.serve_chat`),
and its result rendered as a Response object or the Responses stream events
(`server.responses_stream`). An error about the chat request names the field the client sent
(`input.2.content.0.image_url`, `tools.0.name`, `text.format`).

Stateless: nothing is stored, every response says `store: false` (a request may send `store`
true or false), and what needs a stored response (`previous_response_id`, `conversation`,
`background`, `item_reference` items) is a 400 naming the field. Other Responses fields Canvas
cannot honour are refused by name unless neutral (`REFUSED`); an unknown field is a 400 naming
it, as on chat. Canvas' sampling extras (`PASSTHROUGH`: seed, top_k, stop, the diffusion knobs)
pass to the chat request as they are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from engine.params import KNOB_NAMES, ParamError
from server.errors import APIError, validation_message
from server.protocol import ChatCompletionRequest
from server.responses_input import Renames, chat_messages, chat_tool_choice, chat_tools
from server.responses_stream import ResponsesRenderer
from server.routes import serve_chat
from server.state import ServerState

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]

STATELESS = "Canvas stores no responses (store is always false); send the whole conversation"
# Responses fields Canvas cannot honour: the values accepted (neutral) and why others are not.
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), f"{STATELESS} as input"),
    "conversation": ((None,), f"{STATELESS} as input"),
    "background": ((None, False), f"a background response needs a stored one; {STATELESS}"),
    "prompt": ((None,), "stored prompt templates are not supported; send instructions"),
    "include": (
        (None, []),
        "no extra output can be included (reasoning comes whole as reasoning items)",
    ),
    "truncation": ((None, "disabled"), "only 'disabled': an input over the context is a 400"),
    "top_logprobs": ((None, 0), "log-probabilities are served on /v1/chat/completions"),
    "max_tool_calls": ((None,), "the number of tool calls cannot be bounded"),
}
# Canvas' (and vLLM's) sampling extras, sent through the SDK's `extra_body`.
PASSTHROUGH = frozenset(KNOB_NAMES) - {"temperature", "top_p"} | {
    "seed",
    "stop",
    "ignore_eos",
    "mode",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
}


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None  # checked as chat's reasoning_effort
    summary: Any = None
    generate_summary: Any = None


class ResponsesRequest(BaseModel):
    """The fields of a Responses request Canvas reads; the others are refused (`REFUSED`),
    passed through (`PASSTHROUGH`) or a 400 naming them (`unknown`)."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: Bool = False
    store: Bool | None = None  # accepted either way: nothing is stored
    text: TextConfig | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    include: Any = None
    truncation: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    def check(self) -> None:
        """ParamError naming the first field Canvas cannot honour or does not know."""
        for name, (neutrals, why) in REFUSED.items():
            value = getattr(self, name)
            if not any(value == n and type(value) is type(n) for n in neutrals):
                raise ParamError(name, why)
        for name in self.model_extra or {}:
            if name not in PASSTHROUGH:
                raise ParamError(name, "is not a parameter of /v1/responses that Canvas knows")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise ParamError("text.verbosity", "Canvas cannot set the verbosity of an answer")
        reasoning = self.reasoning or ReasoningConfig()
        for name in ("summary", "generate_summary"):
            if getattr(reasoning, name) is not None:
                raise ParamError(
                    f"reasoning.{name}",
                    "Canvas writes no reasoning summaries: the thoughts come whole, as a "
                    "reasoning item's reasoning_text content",
                )

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format`."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        for name in ("name", "schema_"):
            if getattr(fmt, name) is None:
                field = name.rstrip("_")
                raise ParamError(f"text.format.{field}", 'is required when type is "json_schema"')
        schema = {"name": fmt.name, "schema": fmt.schema_}
        schema.update({k: getattr(fmt, k) for k in ("description", "strict")})
        return {"type": "json_schema", "json_schema": schema}

    def echo(self) -> dict[str, Any]:
        """What a Response object repeats of this request."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text else {}
        reasoning = self.reasoning.effort if self.reasoning is not None else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": self.tools or [],
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "text": {"format": {"type": "text"}, **text},
            "reasoning": {"effort": reasoning, "summary": None},
            "metadata": self.metadata or {},
            "user": self.user,
        }


def chat_request(body: ResponsesRequest, renames: Renames) -> ChatCompletionRequest:
    """The chat request `body` means; ParamError or APIError (400) naming the chat parameter
    at fault (`renames` names it as the client sent it)."""
    body.check()
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.instructions, body.input, renames),
        "stream": body.stream,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
        "tools": chat_tools(body.tools, renames),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": body.response_format(),
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        **(body.model_extra or {}),
    }
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as exc:
        message, param, code = validation_message(list(exc.errors()))
        raise APIError(400, message, param, code) from None


def renamed(error: APIError, renames: Renames) -> APIError:
    """`error` naming the Responses field its chat parameter came from."""
    old, new = error.param, renames(error.param)
    if old is not None and new is not None and new != old:
        error.message = error.message.replace(old, new, 1)
        error.param = new
    return error


def responses_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        renames = Renames()
        renderer = ResponsesRenderer(
            request.state.response_key, state.response_name(body.model), body.stream, body.echo()
        )
        try:
            chat = chat_request(body, renames)
            response = await serve_chat(state, chat, renderer, request)
        except ParamError as exc:
            raise renamed(APIError(400, str(exc), exc.param), renames) from None
        except APIError as exc:
            raise renamed(exc, renames) from None
        if isinstance(response, StreamingResponse):
            # The chat stream's frames, as Responses events; the response still owns the
            # run and its admission ticket (`server.run.SSEResponse`).
            frames = cast(Any, response.body_iterator)
            response.body_iterator = renderer.events(frames)
        return response

    return router
