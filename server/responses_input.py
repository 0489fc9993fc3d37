"""A Responses API request's `instructions`, `input` items and tools as a chat request's
messages and tools, with a map back from chat parameter names to the fields the client sent.

- `instructions` is a first system message; `input` a string is one user message.
- A `message` item (role user, system, developer or assistant; `type` may be left out) keeps
  its content: a string, or parts: `input_text` and `output_text` are text parts,
  `input_image` (`image_url`: a data: URL, or an http(s) URL the server may fetch) an
  `image_url` part. Files, audio and refusals are refused by name.
- A `function_call` item is an assistant tool call (`call_id` its id); calls that follow an
  assistant message or each other join that assistant turn, as the model wrote them.
- A `function_call_output` item is the tool message answering `call_id`.
- A `reasoning` item (what a response's output carries) gives its text to the assistant
  message or call that follows it, as the chat history's `reasoning`.
- Items of hosted tools and references to stored items are refused by name: Canvas calls
  functions only and stores nothing.
"""

from __future__ import annotations

from typing import Any

from engine.params import ParamError

ROLES = ("user", "system", "developer", "assistant")
MESSAGE_FIELDS = ("type", "role", "content", "id", "status", "phase")
CALL_FIELDS = ("type", "call_id", "name", "arguments", "id", "status")
OUTPUT_FIELDS = ("type", "call_id", "output", "id", "status")
REASONING_FIELDS = ("type", "id", "summary", "content", "encrypted_content", "status")
PART_FIELDS = {
    "input_text": ("type", "text"),
    "output_text": ("type", "text", "annotations", "logprobs"),
    "input_image": ("type", "image_url", "detail", "file_id"),
}
REFUSED_PARTS = {
    "input_file": "file input is not supported",
    "input_audio": "audio input is not supported",
    "refusal": "a refusal cannot be shown to the model (send its text as output_text)",
}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# Chat parameters whose Responses field has another name, wherever they came from.
FIXED_RENAMES = (
    ("messages", "input"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
    ("tool_choice.function", "tool_choice"),
)


class Renames:
    """Which Responses field each chat parameter came from: a parameter is renamed by its
    longest known prefix (`messages.3.content.1` -> `input.2.content.1`)."""

    def __init__(self) -> None:
        self._fields: dict[str, str] = dict(FIXED_RENAMES)

    def add(self, chat: str, responses: str) -> None:
        self._fields[chat] = responses

    def __call__(self, param: str | None) -> str | None:
        if param is None:
            return None
        head = param
        while head not in self._fields:
            if "." not in head:
                return param
            head = head.rsplit(".", 1)[0]
        return self._fields[head] + param[len(head) :]


def _only(where: str, item: dict[str, Any], fields: tuple[str, ...], kind: str) -> None:
    for key in item:
        if key not in fields:
            raise ParamError(f"{where}.{key}", f"is not a field of {kind}")


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ParamError(where, "must be a string")
    return value


def chat_messages(
    instructions: str | None, items: str | list[Any], renames: Renames
) -> list[dict[str, Any]]:
    """The chat messages of `instructions` and `input`; ParamError naming the item (and
    its field) that cannot be served. Records in `renames` where each message came from."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        renames.add("messages.0", "instructions")
        renames.add("messages.0.content", "instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        renames.add(f"messages.{len(messages)}", "input")
        return [*messages, {"role": "user", "content": items}]
    if not items:
        raise ParamError("input", "must not be empty")
    thought: tuple[str, str] | None = None  # a reasoning item's text and where it was
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ParamError(where, "must be an object: a message or an item")
        kind = item.get("type", "message")
        if kind == "reasoning":
            if thought is not None:
                raise ParamError(where, "follows another reasoning item (send one per turn)")
            thought = (_reasoning(where, item), where)
            continue
        if kind == "message":
            message = _message(where, item)
            renames.add(f"messages.{len(messages)}", where)
            messages.append(message)
        elif kind == "function_call":
            message = _add_call(where, item, messages, renames, thought is not None)
        elif kind == "function_call_output":
            _add_output(where, item, messages, renames)
            message = messages[-1]
        else:
            raise ParamError(f"{where}.type", _item_refusal(kind))
        if thought is not None:
            if message["role"] != "assistant":
                raise ParamError(
                    thought[1], "must be followed by the assistant message or call it led to"
                )
            message["reasoning"] = thought[0]
            renames.add(f"messages.{len(messages) - 1}.reasoning", thought[1])
            thought = None
    if thought is not None:
        raise ParamError(thought[1], "must be followed by the assistant message or call it led to")
    return messages


def _item_refusal(kind: Any) -> str:
    if kind == "item_reference":
        return "refers to a stored item; Canvas stores nothing (send the item itself)"
    return (
        f"{kind!r} items are not supported: Canvas takes {', '.join(ITEM_TYPES)} items "
        "(it calls functions only)"
    )


def _message(where: str, item: dict[str, Any]) -> dict[str, Any]:
    _only(where, item, MESSAGE_FIELDS, "a message item")
    role = item.get("role")
    if role not in ROLES:
        raise ParamError(f"{where}.role", f"must be one of {', '.join(ROLES)}")
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(f"{where}.content.{j}", part) for j, part in enumerate(content)]
    elif not isinstance(content, str):
        raise ParamError(f"{where}.content", "must be a string or a list of content parts")
    return {"role": role, "content": content}


def _part(where: str, part: Any) -> dict[str, Any]:
    """A content part as chat's: a text part or an image_url part."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ParamError(where, 'must be a content part: an object with a "type"')
    kind = part["type"]
    if kind in REFUSED_PARTS:
        raise ParamError(f"{where}.type", REFUSED_PARTS[kind])
    if kind not in PART_FIELDS:
        expected = ", ".join(PART_FIELDS)
        raise ParamError(f"{where}.type", f"unknown part type {kind!r}; expected {expected}")
    _only(where, part, PART_FIELDS[kind], f"an {kind} part")
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise ParamError(f"{where}.file_id", "uploaded files are not supported; send image_url")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise ParamError(
                f"{where}.image_url",
                "must be a URL: a data: URL, or an http(s) URL the server may fetch",
            )
        return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}}
    if part.get("annotations"):
        raise ParamError(f"{where}.annotations", "annotations cannot be shown to the model")
    return {"type": "text", "text": part.get("text")}


def _add_call(
    where: str,
    item: dict[str, Any],
    messages: list[dict[str, Any]],
    renames: Renames,
    thought: bool,
) -> dict[str, Any]:
    """Add a function_call item to the assistant turn it belongs to (the assistant message
    just before it, unless a reasoning item starts a new turn); returns that message."""
    _only(where, item, CALL_FIELDS, "a function_call item")
    call_id = _string(f"{where}.call_id", item.get("call_id"))
    name = _string(f"{where}.name", item.get("name"))
    arguments = _string(f"{where}.arguments", item.get("arguments"))
    if messages and messages[-1]["role"] == "assistant" and not thought:
        message = messages[-1]
    else:
        message = {"role": "assistant", "content": None}
        renames.add(f"messages.{len(messages)}", where)
        messages.append(message)
    calls = message.setdefault("tool_calls", [])
    call = f"messages.{len(messages) - 1}.tool_calls.{len(calls)}"
    renames.add(call, where)
    renames.add(f"{call}.id", f"{where}.call_id")
    renames.add(f"{call}.function", where)
    function = {"name": name, "arguments": arguments}
    calls.append({"id": call_id, "type": "function", "function": function})
    return message


def _add_output(
    where: str, item: dict[str, Any], messages: list[dict[str, Any]], renames: Renames
) -> None:
    _only(where, item, OUTPUT_FIELDS, "a function_call_output item")
    call_id = _string(f"{where}.call_id", item.get("call_id"))
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            converted = _part(f"{where}.output.{j}", part)
            if converted["type"] != "text":
                raise ParamError(f"{where}.output.{j}.type", "a function output must be text")
            texts.append(_string(f"{where}.output.{j}.text", converted["text"]))
        output = "\n".join(texts)
    k = len(messages)
    renames.add(f"messages.{k}", where)
    renames.add(f"messages.{k}.tool_call_id", f"{where}.call_id")
    renames.add(f"messages.{k}.content", f"{where}.output")
    messages.append({"role": "tool", "tool_call_id": call_id, "content": output})


def _reasoning(where: str, item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text parts (else its summary), joined."""
    _only(where, item, REASONING_FIELDS, "a reasoning item")
    if item.get("encrypted_content") is not None:
        raise ParamError(
            f"{where}.encrypted_content", "Canvas writes no encrypted reasoning to read back"
        )
    texts = []
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise ParamError(f"{where}.{key}", "must be a list of text parts")
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise ParamError(f"{where}.{key}.{j}.text", "must be a string")
            texts.append(part["text"])
        if texts:
            break
    return "\n".join(texts)


def chat_tools(tools: list[Any] | None, renames: Renames) -> list[dict[str, Any]] | None:
    """The function tools in chat's shape; ParamError naming a tool of another type."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise ParamError(where, "must be a tool object")
        if tool.get("type") != "function":
            raise ParamError(
                f"{where}.type",
                f"{tool.get('type')!r} tools are not supported: Canvas calls functions only "
                "(type 'function')",
            )
        renames.add(f"{where}.function", where)
        function = {k: v for k, v in tool.items() if k != "type"}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: Any) -> Any:
    """`tool_choice` in chat's shape: the same strings; {"type": "function", "name"} as
    {"type": "function", "function": {"name"}}; ParamError for other kinds."""
    if not isinstance(choice, dict):
        return choice  # a string or None, checked by the chat request
    if choice.get("type") != "function":
        raise ParamError(
            "tool_choice.type",
            f"{choice.get('type')!r} is not supported: Canvas takes 'none', 'auto', 'required' "
            'or {"type": "function", "name": ...}',
        )
    _only("tool_choice", choice, ("type", "name"), "a function tool choice")
    return {"type": "function", "function": {"name": choice.get("name")}}
