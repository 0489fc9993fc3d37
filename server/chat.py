"""A chat request's inputs to the chat template (messages, tools, the thinking switch) and the
parser of its output, checked with errors that name the parameter.

Content given as parts is joined to one text (text parts, separated by a newline, as vLLM joins
them). A user message's `image_url` parts (a data: URL, or an http(s) URL the server may fetch:
`server.media`) are kept in place: the template is given the message's parts, text and image,
and writes one image placeholder per image (expanded to the image's soft tokens later, by
`engine.inputs.images`); the images are collected in conversation order. Audio, video and file parts
are refused.
Assistant tool calls in the history reach the template with their arguments parsed (templates
write them out in the model's own syntax); a tool message gets the name of the call it answers.
An assistant's thoughts (`reasoning`, or its older name `reasoning_content`) reach the template
as `reasoning_content`, from the current turn only (the messages after the last user
message). The openai SDK's `message.model_dump()` is a valid history message: its null
`refusal`, `annotations`, `audio` and `function_call` are accepted, values are refused.
A template that cannot render tools still serves a forced tool choice (a named function or
"required"): the tool's schema constrains the output, and the tools are described to the model
in a system-message preamble instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.params import ParamError
from server.media import ImageRef
from server.parsers import (
    Gemma4Parser,
    NamedCallParser,
    OutputParser,
    RequiredCallsParser,
)
from server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    NamedToolChoice,
    ToolCallItem,
    ToolChoice,
    check_text,
)

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_FIELDS = ("name", "description", "parameters")  # what the preamble shows of a function
# Fields of the openai SDK's `message.model_dump()` that Canvas has nothing to render for: each
# is accepted null (or an empty list), and any other value is refused, saying why.
SDK_FIELDS = {
    "refusal": "a refusal cannot be shown to the model (send its text as content)",
    "annotations": "annotations (URL citations) cannot be shown to the model",
    "audio": "audio output is not supported",
    # The legacy half of function calling: `functions` is refused, and so is a `function`
    # message answering a call, so a history call is refused too rather than half-mapped.
    "function_call": "the legacy function call is not supported (send tool_calls)",
}
MEDIA_PARTS = {
    "image": "image",
    "input_image": "image",
    "input_audio": "audio",
    "audio": "audio",
    "video": "video",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
}


class ChatTemplateInfo(Protocol):
    """What a tokenizer says about its chat template."""

    @property
    def template_knows_tools(self) -> bool: ...

    @property
    def template_knows_thinking(self) -> bool: ...

    @property
    def template_defaults(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ChatInputs:
    """What the chat template is given."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    images: list[ImageRef]  # the image parts, in conversation order


def chat_inputs(request: ChatCompletionRequest, template: ChatTemplateInfo) -> ChatInputs:
    """The template inputs of `request`; ParamError naming the parameter when a message, a
    tool or a template switch is invalid or the checkpoint's template cannot honour it."""
    images: list[ImageRef] = []
    messages = template_messages(request.messages, images)
    tools = template_tools(request, template)
    if tools is not None and not template.template_knows_tools:
        messages = with_tools_preamble(messages, tools, request.tool_choice)
        tools = None
    asked = thinking_switch(request)
    if asked is not None and not template.template_knows_thinking:
        param = (
            "reasoning_effort"
            if request.chat_template_kwargs is None
            else ("chat_template_kwargs.enable_thinking")
        )
        raise ParamError(param, "this checkpoint's chat template has no thinking switch")
    # The request's switch, else the server's default (`--default-chat-template-kwargs`).
    thinking = asked if asked is not None else template.template_defaults.get("enable_thinking")
    if thinking and is_forced(request.tool_choice):
        raise ParamError(
            "tool_choice",
            "a forced tool choice constrains the whole output to the call's JSON, so it cannot "
            "be combined with thinking (enable_thinking / reasoning_effort)",
        )
    fmt = request.response_format
    if thinking and fmt is not None and fmt.type != "text":
        raise ParamError(
            "response_format",
            "a JSON response format constrains the whole output, so it cannot be combined with "
            "thinking (enable_thinking / reasoning_effort)",
        )
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    return ChatInputs(messages, tools, kwargs, images)


def is_forced(choice: ToolChoice) -> bool:
    """A named function or "required": the output is the call, constrained to its schema."""
    return isinstance(choice, NamedToolChoice) or choice == "required"


def with_tools_preamble(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], choice: ToolChoice
) -> list[dict[str, Any]]:
    """`messages` with the tools described in the system message (prepended to the first one,
    or a new one first), for a template that cannot render them: one line per function (its
    name, description and parameters as JSON), then what the answer must be. Only for a
    forced choice, whose schema constraint makes the answer a valid call whatever the model
    makes of the text."""
    lines = ["You can call these functions:"]
    for tool in tools:
        function = tool["function"]
        lines.append(json.dumps({k: function[k] for k in TOOL_FIELDS if k in function}))
    if isinstance(choice, NamedToolChoice):
        lines.append(
            f"Call {choice.function.name}: answer with its arguments only, as one JSON object."
        )
    else:
        lines.append(
            'Call one or more of them: answer with a JSON array of calls, each {"name": '
            '<function name>, "arguments": <its arguments as a JSON object>}.'
        )
    preamble = "\n".join(lines)
    if messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{preamble}\n\n{messages[0]['content']}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def output_parser(request: ChatCompletionRequest) -> Callable[[], OutputParser]:
    """A factory of the parser of each choice's output."""
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return lambda: NamedCallParser(name)
    if choice == "required":
        return RequiredCallsParser
    parse_tools = bool(request.tools) and choice != "none"
    max_calls = 1 if request.parallel_tool_calls is False else None
    return lambda: Gemma4Parser(parse_tools, max_calls)


def thinking_switch(request: ChatCompletionRequest) -> bool | None:
    """The template's `enable_thinking`: from `chat_template_kwargs`, or from
    `reasoning_effort` ("none": off, any other effort: on); None when neither asks."""
    kwargs = request.chat_template_kwargs or {}
    for key in kwargs:
        if key != "enable_thinking":
            raise ParamError(
                f"chat_template_kwargs.{key}",
                "is not a template switch Canvas passes (only 'enable_thinking')",
            )
    explicit = kwargs.get("enable_thinking")
    if explicit is not None and not isinstance(explicit, bool):
        raise ParamError("chat_template_kwargs.enable_thinking", "must be a boolean")
    effort = request.reasoning_effort
    implied = None if effort is None else effort != "none"
    if explicit is not None and implied is not None and explicit != implied:
        raise ParamError(
            "reasoning_effort",
            f"'{effort}' contradicts chat_template_kwargs.enable_thinking={explicit}",
        )
    return explicit if explicit is not None else implied


def template_tools(
    request: ChatCompletionRequest, template: ChatTemplateInfo
) -> list[dict[str, Any]] | None:
    """The request's tools for the template, checked; None when it has none."""
    if request.tool_choice not in (None, "none") and not request.tools:
        raise ParamError("tool_choice", "needs tools: there is no function to call")
    if not request.tools:
        return None
    if not template.template_knows_tools and not is_forced(request.tool_choice):
        raise ParamError(
            "tools",
            "this checkpoint's chat template does not render tools, so the model could not "
            "see them and would not call them in its own format; force a call with a named "
            "tool_choice or tool_choice 'required' (the tool's schema then constrains the "
            "output), or send the request without tools",
        )
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        name = tool.function.name
        if not FUNCTION_NAME.fullmatch(name):
            raise ParamError(
                f"tools.{i}.function.name",
                "must be 1 to 64 letters, digits, underscores or dashes",
            )
        if name in seen:
            raise ParamError(f"tools.{i}.function.name", f"'{name}' is defined twice")
        seen.add(name)
        check_parameters(f"tools.{i}.function.parameters", tool.function.parameters)
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def check_parameters(param: str, schema: dict[str, Any] | None) -> None:
    """A function's `parameters` must be a JSON schema of an object."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise ParamError(f"{param}.type", "must be 'object': a function's arguments are an object")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
        isinstance(v, dict) for v in properties.values()
    ):
        raise ParamError(f"{param}.properties", "must map each argument name to a JSON schema")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ParamError(f"{param}.required", "must be a list of argument names")


def template_messages(
    messages: list[ChatMessage], images: list[ImageRef] | None = None
) -> list[dict[str, Any]]:
    """The conversation for the template, checked; user messages' image parts are appended to
    `images` (refused when it is None). Thoughts reach the template only from the assistant
    messages after the last user message (the current turn's tool-call loop): an agent that
    sends every message back with its thoughts would otherwise replay each earlier turn's
    chain of thought into every prompt, which Gemma 4's format forbids (its template drops
    them) and which the model then echoes."""
    if not messages:
        raise ParamError("messages", "must contain at least one message")
    call_names: dict[str, str] = {}  # tool call id -> function name, from the history
    shown = [_message(f"messages.{i}", m, call_names, images) for i, m in enumerate(messages)]
    last_user = max((i for i, m in enumerate(shown) if m["role"] == "user"), default=-1)
    for message in shown[:last_user]:
        message.pop("reasoning_content", None)
    return shown


def _message(
    param: str, m: ChatMessage, call_names: dict[str, str], images: list[ImageRef] | None
) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    text = content_text(f"{param}.content", m.content, images if role == "user" else None)
    for name, why in SDK_FIELDS.items():
        if getattr(m, name) not in (None, []):
            raise ParamError(f"{param}.{name}", why)
    if role != "assistant":
        for name in ("tool_calls", "reasoning", "reasoning_content"):
            if getattr(m, name) is not None:
                raise ParamError(f"{param}.{name}", "only assistant messages carry it")
    if role != "tool" and m.tool_call_id is not None:
        raise ParamError(f"{param}.tool_call_id", "only tool messages carry it")
    if text is None and not (role == "assistant" and m.tool_calls):
        raise ParamError(f"{param}.content", "is required (a string or a list of text parts)")
    message: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant":
        if m.tool_calls:
            message["tool_calls"] = [
                _history_call(f"{param}.tool_calls.{j}", call, call_names)
                for j, call in enumerate(m.tool_calls)
            ]
        thought = history_reasoning(param, m)
        if thought is not None:
            message["reasoning_content"] = thought
    if role == "tool":
        if m.tool_call_id is None:
            raise ParamError(f"{param}.tool_call_id", "is required in a tool message")
        if m.tool_call_id not in call_names:
            raise ParamError(
                f"{param}.tool_call_id", "matches no tool call of an earlier assistant message"
            )
        message.update(tool_call_id=m.tool_call_id, name=call_names[m.tool_call_id])
    return message


def history_reasoning(param: str, m: ChatMessage) -> str | None:
    """An assistant message's thoughts, under vLLM's newer name (`reasoning`) or its older one
    (`reasoning_content`); given under both, they must be the same text."""
    for name in ("reasoning", "reasoning_content"):
        if getattr(m, name) is not None:
            check_text(f"{param}.{name}", getattr(m, name))
    if None not in (m.reasoning, m.reasoning_content) and m.reasoning != m.reasoning_content:
        raise ParamError(
            f"{param}.reasoning",
            "differs from reasoning_content: both name the message's thoughts (send one, or "
            "the same text under both)",
        )
    return m.reasoning if m.reasoning is not None else m.reasoning_content


def _history_call(param: str, call: ToolCallItem, call_names: dict[str, str]) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ParamError(f"{param}.function.arguments", "must be a JSON object (as a string)")
    call_names[call.id] = call.function.name
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def content_text(
    param: str, content: str | list[ContentPart] | None, images: list[ImageRef] | None = None
) -> str | list[dict[str, str]] | None:
    """A message's content for the template: the string, or its text parts joined by
    newlines; with image parts (accepted where `images` is given: they are appended to it),
    the list of its parts ({"type": "text", "text"} and {"type": "image"}) in order."""
    if content is None:
        return None
    if isinstance(content, str):
        check_text(param, content)
        return content
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        if part.type == "image_url":
            if images is None:
                raise ParamError(f"{where}.type", "image parts are accepted in user messages only")
            images.append(ImageRef(f"{where}.image_url", image_url(f"{where}", part)))
            parts.append({"type": "image"})
            continue
        if part.type in MEDIA_PARTS:
            kind = MEDIA_PARTS[part.type]
            hint = " (send images as 'image_url' parts)" if kind == "image" else ""
            raise ParamError(f"{where}.type", f"{kind} input is not supported{hint}")
        if part.type != "text":
            raise ParamError(
                f"{where}.type",
                f"unknown part type {part.type!r}; expected 'text' or 'image_url'",
            )
        if not isinstance(part.text, str):
            raise ParamError(f"{where}.text", "must be a string")
        for extra in part.model_extra or {}:
            raise ParamError(f"{where}.{extra}", "is not a field of a text part")
        check_text(f"{where}.text", part.text)
        if parts and parts[-1]["type"] == "text":  # text parts join with a newline
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + "\n" + part.text}
        else:
            parts.append({"type": "text", "text": part.text})
    if all(p["type"] == "text" for p in parts):
        return parts[0]["text"] if parts else ""
    return parts


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's `detail`: accepted, ignored


def image_url(param: str, part: ContentPart) -> str:
    """The URL of an `image_url` part ({"url": ..., "detail": ...}, or the URL alone as some
    clients send it), checked."""
    extra = dict(part.model_extra or {})
    value = extra.pop("image_url", None)
    for name in extra:
        raise ParamError(f"{param}.{name}", "is not a field of an image_url part")
    if part.text is not None:
        raise ParamError(f"{param}.text", "is not a field of an image_url part")
    if isinstance(value, str):
        value = {"url": value}
    if not isinstance(value, dict):
        raise ParamError(f"{param}.image_url", 'must be an object {"url": ...}')
    url = value.get("url")
    if not isinstance(url, str) or not url:
        raise ParamError(f"{param}.image_url.url", "must be a non-empty string")
    for key in value:
        if key not in ("url", "detail"):
            raise ParamError(f"{param}.image_url.{key}", "is not a field of image_url")
    if (value.get("detail") or "auto") not in IMAGE_DETAILS:
        raise ParamError(f"{param}.image_url.detail", f"must be one of {list(IMAGE_DETAILS)}")
    return url
