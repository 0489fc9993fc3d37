"""Response bodies: one renderer per response kind (text completion, chat completion).

A route picks its renderer once; nothing downstream tests which kind it is serving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.types import FinishReason, RequestStats
from server.stream import ChoiceEvent


@dataclass(slots=True)
class ChoiceResult:
    """A choice as the full (non-streamed) response shows it."""

    index: int
    text: str
    num_tokens: int  # up to a stop string, when one cut the text
    finish_reason: FinishReason | None
    stats: RequestStats | None


def canvas_stats(stats: RequestStats | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {
        "steps_per_canvas": list(stats.steps_per_canvas),
        "decoder_passes": stats.decoder_passes,
        "tokens_per_forward": stats.tokens_per_forward,
    }


def usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
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
        self.created = int(time.time())

    def response(self, choices: list[ChoiceResult], num_prompt: int) -> dict[str, Any]:
        items = [
            {
                "index": c.index,
                "finish_reason": c.finish_reason,
                "logprobs": None,
                **self._content(c.text),
                "canvas_stats": canvas_stats(c.stats),
            }
            for c in choices
        ]
        num_completion = sum(c.num_tokens for c in choices)
        body = {**self._head(self.object), "choices": items}
        return {**body, "usage": usage(num_prompt, num_completion)}

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks sent before any output."""
        return []

    def chunk(
        self, event: ChoiceEvent, draft: str | None, draft_tokens: list[str] | None = None
    ) -> dict[str, Any]:
        item: dict[str, Any] = {
            "index": event.index,
            "finish_reason": event.finish_reason,
            "logprobs": None,
            **self._delta(event.delta),
        }
        if draft is not None:
            item["draft"] = draft  # an argmax preview of the unfinished canvas; not content
        if draft_tokens is not None:
            item["draft_tokens"] = draft_tokens  # the same draft, one string per position
        if event.finish_reason is not None:
            item["canvas_stats"] = canvas_stats(event.stats)
        return self._chunk([item])

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict[str, Any]:
        body = {**self._head(self.chunk_object), "choices": []}
        return {**body, "usage": usage(num_prompt, num_completion)}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head(self.chunk_object), "choices": items}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _content(self, text: str) -> dict[str, Any]:
        raise NotImplementedError

    def _delta(self, text: str) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"
    prompt_param = "prompt"

    def _content(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"text": text}


class ChatRenderer(Renderer):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """The role arrives first, as OpenAI sends it."""
        role = {"content": "", "role": "assistant"}
        return [
            self._chunk([{"index": i, "finish_reason": None, "logprobs": None, "delta": role}])
            for i in range(num_choices)
        ]

    def _content(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def _delta(self, text: str) -> dict[str, Any]:
        return {"delta": {"content": text} if text else {}}
