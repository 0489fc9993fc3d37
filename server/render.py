"""Response bodies: one renderer per response kind (text completion, chat completion).

A route picks its renderer once; nothing downstream tests which kind it is serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.types import RequestStats
from server.logprobs import ShownLogprob, chat_logprobs, completion_logprobs
from server.parsers import Parsed, ToolCallDelta
from server.stream import ChoiceEvent


@dataclass(slots=True)
class ChoiceResult:
    """A choice as the full (non-streamed) response shows it."""

    index: int
    text: str  # chat: the content, apart from reasoning and tool calls
    num_tokens: int  # up to a stop string, when one cut the text
    finish_reason: str | None
    stats: RequestStats | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    num_reasoning_tokens: int = 0
    logprobs: list[ShownLogprob] | None = None  # when the request asked for them


def canvas_stats(stats: RequestStats | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {
        "steps_per_canvas": list(stats.steps_per_canvas),
        "decoder_passes": stats.decoder_passes,
        "tokens_per_forward": stats.tokens_per_forward,
    }


def usage(num_prompt: int, num_completion: int, num_cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `num_cached`: prompt tokens whose KV came from the prefix
    cache."""
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


class Renderer:
    """The bodies of one response: the full response, its stream chunks, the usage chunk."""

    object: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]
    prompt_param: ClassVar[str]  # the request field a prompt error names

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.response_id = f"{self.id_prefix}{request_id}"
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = False  # every chunk carries the usage so far (`server.run`)
        self.created = int(time.time())

    def response(
        self, choices: list[ChoiceResult], num_prompt: int, num_cached: int = 0
    ) -> dict[str, Any]:
        items = [
            {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": self._logprobs(c.logprobs),
                **self._content(c),
                "canvas_stats": canvas_stats(c.stats),
            }
            for c in choices
        ]
        body = {**self._head(self.object), "choices": items}
        return {**body, "usage": self._usage(num_prompt, choices, num_cached)}

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks sent before any output."""
        return []

    def chunk(
        self,
        event: ChoiceEvent,
        draft: str | None,
        draft_tokens: list[str] | None = None,
        verified: tuple[list[str], int] | None = None,
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "index": event.index,
            "finish_reason": event.finish_reason,
            "logprobs": self._logprobs(event.logprobs),
            **self._delta(event.delta),
        }
        if draft is not None:
            item["draft"] = draft  # an argmax preview of the unfinished canvas; not content
        if draft_tokens is not None:
            item["draft_tokens"] = draft_tokens  # the same draft, one string per position
        if verified is not None:  # hybrid: the draft a verify pass saw and what it kept
            item["verified"] = {"draft_tokens": verified[0], "accepted": verified[1]}
        if event.finish_reason is not None:
            item["canvas_stats"] = canvas_stats(event.stats)
        return self._chunk([item])

    def usage_chunk(
        self, num_prompt: int, choices: list[ChoiceResult], num_cached: int = 0
    ) -> dict[str, Any]:
        body = {**self._head(self.chunk_object), "choices": []}
        return {**body, "usage": self._usage(num_prompt, choices, num_cached)}

    def _usage(
        self, num_prompt: int, choices: list[ChoiceResult], num_cached: int
    ) -> dict[str, Any]:
        return usage(num_prompt, sum(c.num_tokens for c in choices), num_cached)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(self.chunk_object), "choices": items}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _content(self, choice: ChoiceResult) -> dict[str, Any]:
        raise NotImplementedError

    def _logprobs(self, shown: list[ShownLogprob] | None) -> dict[str, Any] | None:
        raise NotImplementedError

    def _delta(self, delta: Parsed) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    prompt_param = "prompt"

    def _content(self, choice: ChoiceResult) -> dict[str, Any]:
        return {"text": choice.text}

    def _logprobs(self, shown: list[ShownLogprob] | None) -> dict[str, Any] | None:
        return None if shown is None else completion_logprobs(shown)

    def _delta(self, delta: Parsed) -> dict[str, Any]:
        return {"text": delta.content}


# `--reasoning-field`: the message and delta fields a chat's thoughts are sent under (vLLM's
# newer name, its older one, or both for clients of either).
REASONING_FIELDS: dict[str, tuple[str, ...]] = {
    "both": ("reasoning", "reasoning_content"),
    "reasoning": ("reasoning",),
    "reasoning_content": ("reasoning_content",),
}


class ChatRenderer(Renderer):
    """Chat bodies: the content apart from the reasoning (under the fields
    `REASONING_FIELDS[reasoning_field]` names) and the tool calls (`tool_calls`; content is
    null when a choice only called tools)."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def __init__(
        self, request_id: str, model: str, include_usage: bool, reasoning_field: str = "both"
    ) -> None:
        super().__init__(request_id, model, include_usage)
        self.reasoning_fields = REASONING_FIELDS[reasoning_field]

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """The role arrives first, as OpenAI sends it."""
        role = {"content": "", "role": "assistant"}
        return [
            self._chunk([{"index": i, "finish_reason": None, "logprobs": None, "delta": role}])
            for i in range(num_choices)
        ]

    def _logprobs(self, shown: list[ShownLogprob] | None) -> dict[str, Any] | None:
        return None if shown is None else chat_logprobs(shown)

    def _content(self, choice: ChoiceResult) -> dict[str, Any]:
        content = None if choice.tool_calls and not choice.text else choice.text
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if choice.reasoning is not None:
            message.update(dict.fromkeys(self.reasoning_fields, choice.reasoning))
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        return {"message": message}

    def _delta(self, delta: Parsed) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if delta.reasoning:
            body.update(dict.fromkeys(self.reasoning_fields, delta.reasoning))
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [piece.openai() for piece in _coalesce(delta.tool_calls)]
        return {"delta": body}

    def _usage(
        self, num_prompt: int, choices: list[ChoiceResult], num_cached: int
    ) -> dict[str, Any]:
        reasoning = sum(c.num_reasoning_tokens for c in choices)
        details = {"completion_tokens_details": {"reasoning_tokens": reasoning}}
        return {**super()._usage(num_prompt, choices, num_cached), **details}


def _coalesce(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Pieces of one call that arrived together, as one piece (a slow reader's merged
    events), so a chunk names each call index once."""
    out: list[ToolCallDelta] = []
    for piece in pieces:
        if out and out[-1].index == piece.index:
            last = out[-1]
            piece = ToolCallDelta(last.index, last.arguments + piece.arguments, last.id, last.name)
            out[-1] = piece
        else:
            out.append(piece)
    return out
