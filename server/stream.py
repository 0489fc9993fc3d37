"""Streaming: one output collector per HTTP request, and the SSE framing.

The engine side of a request (one task per choice) `put`s events into the collector and never
waits; the client side takes whatever is pending. When the client reads slowly, a choice's
pending events merge — text, reasoning and tool calls append, the newest draft replaces older
ones — so a request holds at most one pending event per choice however many drafts it streams.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from engine.types import RequestStats
from server.logprobs import ShownLogprob
from server.parsers import Parsed

DONE = "data: [DONE]\n\n"


@dataclass(slots=True)
class ChoiceEvent:
    """What a choice has produced since the client last read: new text (content, reasoning,
    tool calls), the newest draft of the unfinished canvas (token ids, decoded only if it is
    sent), and how it ended ("tool_calls" when its tool calls ended it)."""

    index: int
    delta: Parsed = field(default_factory=Parsed)
    draft_ids: list[int] | None = None
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: list[ShownLogprob] | None = None  # of the tokens this event commits
    # hybrid: the newest verify pass's proposals (token ids) and how many were accepted
    verified: tuple[list[int], int] | None = None
    num_tokens: int = 0  # the choice's completion tokens so far (continuous usage stats)

    def merge(self, later: ChoiceEvent) -> None:
        self.delta.merge(later.delta)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.draft_ids = later.draft_ids  # a commit without a draft makes older drafts stale
        if later.verified is not None:  # drawn before the draft: the newest verdict is kept
            self.verified = later.verified
        self.finish_reason = later.finish_reason
        self.stats = later.stats
        self.num_tokens = later.num_tokens


class OutputCollector:
    """Events of a request's `num_choices` choices, for one reader.

    `put`, `close` and `fail` never wait. `get` returns every pending event (in order of first
    arrival), then, once they are all read, raises the first failure or returns None when all
    choices are closed."""

    def __init__(self, num_choices: int) -> None:
        self._pending: dict[int, ChoiceEvent] = {}
        self._ready = asyncio.Event()
        self._num_open = num_choices
        self._error: BaseException | None = None

    def put(self, event: ChoiceEvent) -> None:
        pending = self._pending.get(event.index)
        if pending is None:
            self._pending[event.index] = event
        else:
            pending.merge(event)
        self._ready.set()

    def close(self) -> None:
        """One choice will put nothing more."""
        self._num_open -= 1
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> list[ChoiceEvent] | None:
        while not self._pending and self._error is None and self._num_open > 0:
            self._ready.clear()
            await self._ready.wait()
        if self._pending:
            events = list(self._pending.values())
            self._pending.clear()
            return events
        if self._error is not None:
            raise self._error
        return None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
