"""Chat output parsers: the model's text split into content, reasoning and tool calls.

DiffusionGemma writes Gemma 4's format: thoughts as ``<|channel>thought\\n...<channel|>``, tool
calls as ``<|tool_call>call:NAME{key:value,...}<tool_call|>`` (keys bare, strings between
``<|"|>``, numbers, booleans, objects and arrays as written), and the turn ends at ``<turn|>``,
``<eos>`` or ``<|tool_response>`` (where a tool's answer would follow). A parser is fed the text
as it is committed, in chunks split anywhere (a chunk may end inside a marker), and returns what
is certain so far; text that may still be the start of a marker is held back until the next
chunk or `finish` decides it.

Forced tool choice has its own parsers: the engine constrains the text to JSON (the arguments of
the named function, or an array of calls for "required"), which becomes tool calls.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

THOUGHT_OPEN, THOUGHT_CLOSE, THOUGHT_LABEL = "<|channel>", "<channel|>", "thought\n"
CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
TURN_ENDS = ("<turn|>", "<eos>", "<|tool_response>")
# Special tokens the decode must keep for the parser to see them (the rest are dropped).
MARKUP = (THOUGHT_OPEN, THOUGHT_CLOSE, CALL_OPEN, CALL_CLOSE, QUOTE, *TURN_ENDS)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of tool call `index`: its first piece carries id and name, every piece a part
    of the arguments (a JSON text once all pieces are joined)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """The OpenAI stream shape of this piece."""
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, **function}
        if self.id is None:
            return {"index": self.index, "function": function}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass(slots=True)
class Parsed:
    """What a parser made of the text so far (or of one chunk)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def merge(self, later: Parsed) -> None:
        self.content += later.content
        self.reasoning += later.reasoning
        self.tool_calls += later.tool_calls

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def join_tool_calls(pieces: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """The full-response `tool_calls` of a choice from its pieces."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        call = calls.setdefault(
            piece.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if piece.id is not None:
            call["id"] = piece.id
        if piece.name is not None:
            call["function"]["name"] = piece.name
        call["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]


class OutputParser(Protocol):
    """Turns a choice's text into content, reasoning and tool calls. `calls_finish`: whether
    a choice that made tool calls ends with finish_reason "tool_calls"."""

    calls_finish: bool
    markup: bool  # fed the model's markup tokens as text (else plain decoded text)

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed:
        """Everything held back, once the text is complete."""
        ...

    @property
    def reasoning_spans(self) -> list[tuple[int, int]]:
        """[start, end) character offsets of the thoughts in the text fed (usage counts the
        tokens that cover them)."""
        ...


class Mode(Enum):
    CONTENT = "content"
    THOUGHT = "thought"
    CALL = "call"
    ENDED = "ended"


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else None


class Gemma4Parser:
    """Incremental parser of Gemma 4 output. Tool calls are parsed only when `tools` is set
    (otherwise their markup is content); a call is sent whole once its closing marker arrives.
    A call that does not parse, or is cut off, is kept as content, so no text is lost. Calls
    past `max_calls` (1 when the request set parallel_tool_calls false) are dropped."""

    calls_finish = True  # a choice that called tools ends with finish_reason "tool_calls"
    markup = True

    def __init__(self, tools: bool, max_calls: int | None = None) -> None:
        self.tools = tools
        self.max_calls = max_calls
        self.mode = Mode.CONTENT
        self.buffer = ""  # text fed but not yet decided
        self.offset = 0  # characters of the text fed before `buffer`
        self.label_checked = False
        self.num_calls = 0
        self._spans: list[tuple[int, int]] = []
        self._thought_start = 0

    @property
    def reasoning_spans(self) -> list[tuple[int, int]]:
        return list(self._spans)

    def _ends(self) -> tuple[str, ...]:
        """The markers that end the current mode's text."""
        call = (CALL_OPEN,) if self.tools else ()
        if self.mode is Mode.CONTENT:
            return (THOUGHT_OPEN, *call, *TURN_ENDS)
        if self.mode is Mode.THOUGHT:
            return (THOUGHT_CLOSE, *call, *TURN_ENDS)
        return (CALL_CLOSE,)

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while self.mode is not Mode.ENDED and self._step(out, final=False):
            pass
        if self.mode is Mode.ENDED:
            self._consume(len(self.buffer))
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        while self.mode is not Mode.ENDED and self.buffer and self._step(out, final=True):
            pass
        if self.mode is Mode.CALL:  # a call cut off: keep its text as content
            out.content += CALL_OPEN + self._consume(len(self.buffer))
        if self.mode is Mode.THOUGHT:
            self._spans.append((self._thought_start, self.offset))
        self.mode = Mode.ENDED
        return out

    def _consume(self, size: int) -> str:
        taken, self.buffer = self.buffer[:size], self.buffer[size:]
        self.offset += size
        return taken

    def _step(self, out: Parsed, final: bool) -> bool:
        """Decide what can be decided of the buffer; True when it should run again."""
        if self.mode is Mode.THOUGHT and not self.label_checked:
            short = not final and len(self.buffer) < len(THOUGHT_LABEL)
            if short and THOUGHT_LABEL.startswith(self.buffer):
                return False  # may still become the label
            self.label_checked = True
            if self.buffer.startswith(THOUGHT_LABEL):
                self._consume(len(THOUGHT_LABEL))
        hit = _first(self.buffer, self._ends())
        if hit is None:
            if self.mode is Mode.CALL:
                return False  # the call is not complete yet
            keep = 0 if final else _held_back(self.buffer, self._ends())
            self._emit(out, self._consume(len(self.buffer) - keep))
            return False
        position, marker = hit
        text = self._consume(position)
        self._consume(len(marker))
        if self.mode is Mode.CALL:
            self._add_call(out, text)
            self.mode = Mode.CONTENT
            return True
        self._emit(out, text)
        if self.mode is Mode.THOUGHT:
            self._spans.append((self._thought_start, self.offset))
        self.mode = self._next_mode(marker)
        return True

    def _next_mode(self, marker: str) -> Mode:
        if marker == THOUGHT_OPEN:
            self._thought_start = self.offset - len(marker)
            self.label_checked = False
            return Mode.THOUGHT
        if marker == CALL_OPEN:
            return Mode.CALL
        if marker == THOUGHT_CLOSE:
            return Mode.CONTENT
        return Mode.ENDED

    def _emit(self, out: Parsed, text: str) -> None:
        if self.mode is Mode.THOUGHT:
            out.reasoning += text
        else:
            out.content += text

    def _add_call(self, out: Parsed, body: str) -> None:
        try:
            name, arguments = parse_call(body)
        except ValueError:
            out.content += CALL_OPEN + body + CALL_CLOSE
            return
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return
        out.tool_calls.append(
            ToolCallDelta(self.num_calls, json.dumps(arguments), new_call_id(), name)
        )
        self.num_calls += 1


def parse_call(body: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a call's body ``call:NAME{...}``; ValueError when malformed."""
    if not body.startswith("call:"):
        raise ValueError("a tool call starts with 'call:'")
    brace = body.find("{")
    name = body[len("call:") : brace].strip()
    if brace < 0 or not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError("a tool call needs a name and then '{'")
    value, end = _GemmaValue(body).parse(brace)
    if body[end:].strip():
        raise ValueError("text after the arguments of a tool call")
    assert isinstance(value, dict)
    return name, value


class _GemmaValue:
    """Recursive-descent reader of Gemma 4's value syntax (JSON with bare keys and <|"|>
    strings)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def parse(self, pos: int) -> tuple[Any, int]:
        pos = self._skip(pos)
        text = self.text
        if text.startswith(QUOTE, pos):
            end = text.find(QUOTE, pos + len(QUOTE))
            if end < 0:
                raise ValueError("an unterminated string")
            return text[pos + len(QUOTE) : end], end + len(QUOTE)
        if text.startswith("{", pos):
            return self._object(pos + 1)
        if text.startswith("[", pos):
            return self._array(pos + 1)
        end = pos
        while end < len(text) and text[end] not in ",}]":
            end += 1
        return _bare(text[pos:end].strip()), end

    def _object(self, pos: int) -> tuple[dict[str, Any], int]:
        result: dict[str, Any] = {}
        pos = self._skip(pos)
        while not self.text.startswith("}", pos):
            if self.text.startswith(QUOTE, pos):
                key, pos = self.parse(pos)
            else:
                colon = self.text.find(":", pos)
                if colon < 0:
                    raise ValueError("a key without a value")
                key, pos = self.text[pos:colon].strip(), colon
            pos = self._skip(pos)
            if not key or not self.text.startswith(":", pos):
                raise ValueError("a key must be followed by ':'")
            result[str(key)], pos = self.parse(pos + 1)
            pos = self._separator(pos, "}")
        return result, pos + 1

    def _array(self, pos: int) -> tuple[list[Any], int]:
        items: list[Any] = []
        pos = self._skip(pos)
        while not self.text.startswith("]", pos):
            item, pos = self.parse(pos)
            items.append(item)
            pos = self._separator(pos, "]")
        return items, pos + 1

    def _separator(self, pos: int, close: str) -> int:
        pos = self._skip(pos)
        if self.text.startswith(",", pos):
            return self._skip(pos + 1)
        if self.text.startswith(close, pos):
            return pos
        raise ValueError(f"expected ',' or '{close}'")

    def _skip(self, pos: int) -> int:
        while pos < len(self.text) and self.text[pos] in " \t\n\r":
            pos += 1
        if pos >= len(self.text):
            raise ValueError("the arguments end early")
        return pos


def _bare(token: str) -> Any:
    """A value written without delimiters: a JSON literal or number, else the text itself."""
    if not token:
        raise ValueError("an empty value")
    try:
        value = json.loads(token)
    except ValueError:
        return token
    if isinstance(value, float) and not math.isfinite(value):
        return token  # NaN and Infinity are not JSON
    return value if isinstance(value, (int, float, bool)) or value is None else token


class NamedCallParser:
    """`tool_choice` naming a function: the whole text (a JSON object, constrained by the
    engine to the function's parameters) is the arguments of one call, streamed as it comes."""

    calls_finish = False  # OpenAI ends a forced named call with finish_reason "stop"
    markup = False  # the output is the arguments' JSON alone

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    @property
    def reasoning_spans(self) -> list[tuple[int, int]]:
        return []

    def feed(self, text: str) -> Parsed:
        if self.started:
            return Parsed(tool_calls=[ToolCallDelta(0, text)] if text else [])
        self.started = True
        return Parsed(tool_calls=[ToolCallDelta(0, text, new_call_id(), self.name)])

    def finish(self) -> Parsed:
        return Parsed() if self.started else self.feed("")


class RequiredCallsParser:
    """`tool_choice` "required": the text is a JSON array of {"name", "arguments"} objects
    (constrained by the engine); the calls are sent once the array is complete. Text that is
    not such an array (cut off by max_tokens) is returned as content."""

    calls_finish = True
    markup = False  # the output is the calls' JSON alone

    def __init__(self) -> None:
        self.text = ""

    @property
    def reasoning_spans(self) -> list[tuple[int, int]]:
        return []

    def feed(self, text: str) -> Parsed:
        self.text += text
        return Parsed()

    def finish(self) -> Parsed:
        try:
            items = json.loads(self.text)
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(_is_call(item) for item in items):
            return Parsed(content=self.text)
        calls = [
            ToolCallDelta(i, json.dumps(item["arguments"]), new_call_id(), item["name"])
            for i, item in enumerate(items)
        ]
        return Parsed(tool_calls=calls)


def _is_call(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and isinstance(item.get("arguments"), dict)
    )
