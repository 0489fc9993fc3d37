"""Response objects and stream events of /v1/responses, made from the chat path's output.

`ResponsesRenderer` is a chat renderer whose full response is a Response object
(`object: "response"`) instead of a chat completion, and whose stream is the chat stream's
chunks turned into the Responses API's typed events (`events`). Both paths build their output
items with one `OutputItems`, fed the chat message (full response) or its deltas (stream), so
a stream's `response.completed` carries exactly the output a plain request would:

- the thoughts: a `reasoning` item whose `content` is one `reasoning_text` part (the thoughts
  in full; `summary` is empty: Canvas writes no summaries);
- the content: a `message` item with one `output_text` part;
- each tool call: a `function_call` item (`call_id`, `name`, `arguments` as a JSON text).

Items appear in the order the model wrote them (a new item starts when the kind of text
changes); an empty output is one empty message. A chat finish "length" makes the response
`incomplete` (reason `max_output_tokens`), its last item too. Nothing is stored: `store` is
always false.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from server.render import ChatRenderer, ChoiceResult

MESSAGE, REASONING, CALL = "message", "reasoning", "function_call"


class OutputItems:
    """The output items of one response as its text arrives. Each feeding method returns the
    stream events (without `sequence_number`) it caused; `items` holds every item, the open
    one as it stands."""

    def __init__(self, response_id: str) -> None:
        self.base = response_id.removeprefix("resp_")
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_index: int | None = None  # the chat tool call the open item is

    def feed(
        self, reasoning: str | None, content: str | None, calls: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """What a chat delta (or a whole chat message) adds: thoughts, then content, then tool
        call pieces in the chat stream's shape ({"index", "id"?, "function": {"name"?,
        "arguments"}})."""
        events: list[dict[str, Any]] = []
        if reasoning:
            events += self._text(REASONING, reasoning)
        if content:
            events += self._text(MESSAGE, content)
        for piece in calls:
            events += self._call(piece)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """End the output: the open item ends with `status` ("completed", or "incomplete" when
        the output was cut at its token limit). An output with no item at all gets an empty
        message, as OpenAI's does, so a client always finds the answer's message."""
        events = [] if self.items else self._open_text(MESSAGE)
        return [*events, *self._close(status)]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the open item with `status`."""
        item, self._open, self._call_index = self._open, None, None
        if item is None:
            return []
        item["status"] = status
        where = self._where(item)
        if item["type"] == CALL:
            args = {"name": item["name"], "arguments": item["arguments"]}
            done = [{"type": "response.function_call_arguments.done", **where, **args}]
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == MESSAGE else "reasoning_text"
            text_done = {"type": f"response.{kind}.done", **where, "content_index": 0}
            text_done["text"] = part["text"]
            if item["type"] == MESSAGE:
                text_done["logprobs"] = []
            part_done = {"type": "response.content_part.done", **where, "content_index": 0}
            done = [text_done, {**part_done, "part": dict(part)}]
        output_index = where["output_index"]
        finished = {"type": "response.output_item.done", "output_index": output_index}
        return [*done, {**finished, "item": _copy(item)}]

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        """Where the open item (always the last) is."""
        return {"item_id": item["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self._open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        return [*events, {**added, "item": _copy(item)}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        item = self._open
        events = [] if item is not None and item["type"] == kind else self._open_text(kind)
        item = self._open
        assert item is not None, "_open_text opened it"
        item["content"][0]["text"] += text
        name = "output_text" if kind == MESSAGE else "reasoning_text"
        delta = {"type": f"response.{name}.delta", **self._where(item), "content_index": 0}
        if kind == MESSAGE:
            delta["logprobs"] = []
        return [*events, {**delta, "delta": text}]

    def _open_text(self, kind: str) -> list[dict[str, Any]]:
        """Start a message or reasoning item, with its one (empty) text part."""
        n = len(self.items)
        if kind == MESSAGE:
            item: dict[str, Any] = {"id": f"msg_{self.base}_{n}", "type": MESSAGE}
            item["role"] = "assistant"
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            part["logprobs"] = []
        else:
            item = {"id": f"rs_{self.base}_{n}", "type": REASONING, "summary": []}
            part = {"type": "reasoning_text", "text": ""}
        item.update(status="in_progress", content=[])
        events = self._start(item)
        added = {"type": "response.content_part.added", **self._where(item)}
        item["content"] = [part]
        return [*events, {**added, "content_index": 0, "part": dict(part)}]

    def _call(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        function = piece.get("function") or {}
        item = self._open
        if item is None or item["type"] != CALL or self._call_index != piece["index"]:
            n = len(self.items)
            item = {"id": f"fc_{self.base}_{n}", "type": CALL, "status": "in_progress"}
            item.update(call_id=piece.get("id") or "", name=function.get("name") or "")
            item["arguments"] = ""
            events += self._start(item)
            self._call_index = piece["index"]
        arguments = function.get("arguments") or ""
        if not arguments:
            return events
        item["arguments"] += arguments
        delta = {"type": "response.function_call_arguments.delta", **self._where(item)}
        return [*events, {**delta, "delta": arguments}]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands (events must not change when the item grows later)."""
    copied = dict(item)
    if "content" in item:
        copied["content"] = [dict(part) for part in item["content"]]
    return copied


def response_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Responses API's usage object of a chat usage object."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": chat_usage["total_tokens"],
    }


def status_of(finish_reason: str | None) -> str:
    """A response's status from its chat choice's finish reason."""
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesRenderer(ChatRenderer):
    """Chat bodies turned into Responses API bodies. `echo`: the request fields a Response
    object repeats (instructions, tools, tool_choice, text, ...), as the client should see
    them."""

    id_prefix = "resp_"

    def __init__(self, request_id: str, model: str, stream: bool, echo: dict[str, Any]) -> None:
        # The usage chunk ends the chat stream, so `response.completed` can carry the usage.
        super().__init__(request_id, model, include_usage=stream, reasoning_field="reasoning")
        self.echo = echo

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        error: dict[str, Any] | None = None,
        canvas_stats: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A Response object."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": error,
            "incomplete_details": incomplete,
            "usage": usage,
            "store": False,  # stateless: nothing is kept after the response
            "previous_response_id": None,
            "background": False,
            "truncation": "disabled",
            **self.echo,
        }
        if canvas_stats is not None:
            body["canvas_stats"] = canvas_stats
        return body

    def response(
        self, choices: list[ChoiceResult], num_prompt: int, num_cached: int = 0
    ) -> dict[str, Any]:
        chat = super().response(choices, num_prompt, num_cached)
        (choice,) = chat["choices"]  # a Responses request has one choice
        message = choice["message"]
        calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
        out = OutputItems(self.response_id)
        out.feed(message.get("reasoning"), message["content"], calls)
        status = status_of(choice["finish_reason"])
        out.finish(status)
        usage = response_usage(chat["usage"])
        return self.body(status, out.items, usage, canvas_stats=choice["canvas_stats"])

    async def events(self, frames: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        """The Responses stream of a chat stream's SSE frames (`server.run.RequestRun.sse`):
        `response.created` and `response.in_progress`, each item's events as its text
        arrives, then `response.completed` (or `response.incomplete`) with the whole
        response; an in-band chat error becomes an `error` event and `response.failed`."""
        numbers = itertools.count()

        def frame(event: dict[str, Any]) -> str:
            data = json.dumps({**event, "sequence_number": next(numbers)}, separators=(",", ":"))
            return f"event: {event['type']}\ndata: {data}\n\n"

        started = self.body("in_progress", [], None)
        yield frame({"type": "response.created", "response": started})
        yield frame({"type": "response.in_progress", "response": started})
        out = OutputItems(self.response_id)
        finish: str | None = None
        usage: dict[str, Any] | None = None
        stats: dict[str, Any] | None = None
        async for sse_frame in frames:
            data = sse_frame.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                fields = {k: error.get(k) for k in ("code", "message", "param")}
                yield frame({"type": "error", **fields})
                failed = {"code": "server_error", "message": error.get("message", "")}
                body = self.body("failed", out.items, None, failed)
                yield frame({"type": "response.failed", "response": body})
                return
            usage = response_usage(chunk.get("usage")) or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                calls = delta.get("tool_calls") or []
                for event in out.feed(delta.get("reasoning"), delta.get("content"), calls):
                    yield frame(event)
                finish = choice["finish_reason"] or finish
                stats = choice.get("canvas_stats") or stats
        status = status_of(finish)
        for event in out.finish(status):
            yield frame(event)
        body = self.body(status, out.items, usage, canvas_stats=stats)
        yield frame({"type": f"response.{status}", "response": body})
