"""The one state object of a request (torch-free): what it asked for, where the scheduler has
it, what it has produced, and an opaque slot for its sampler's state. The scheduler, the engine,
the row kinds and the samplers all read and write this object; nothing is kept in a second dict
by the same id."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from engine.kv_pages import PageTables
from engine.params import DecodeMode, ResolvedParams
from engine.types import FinishReason

if TYPE_CHECKING:
    from engine.structured import Constraint


class SeqState(str, Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DENOISE = "denoise"
    COMMIT = "commit"
    AR = "ar"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    context: int  # positions reserved: prompt + token budget rounded up to whole canvases
    canvas_length: int
    want_drafts: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    # scheduling
    state: SeqState = SeqState.WAITING
    num_computed: int = 0  # positions whose KV is written
    pages: PageTables | None = None
    # progress
    output_ids: list[int] = field(default_factory=list)
    draft_to_commit: list[int] | None = None
    in_canvas: bool = False  # a canvas is being denoised
    canvas_started: float = 0.0
    steps_per_canvas: list[int] = field(default_factory=list)
    decoder_passes: int = 0
    encoder_passes: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # The sampler's own state: a slot of the batched sampler (fast numerics) or a private
    # generator and canvas (exact numerics); see `engine.sampling`.
    sampler_state: object | None = None
    constraint: Constraint | None = None  # the request's grammar state (structured output)

    @property
    def remaining(self) -> int:
        """Tokens left in the budget."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_ar(self) -> bool:
        return self.params.mode is DecodeMode.AR


def first_cut(
    draft: list[int], budget: int, eos_token_ids: frozenset[int]
) -> tuple[list[int], FinishReason | None]:
    """Cut a committed draft at the first EOS (kept) and at the remaining token budget."""
    for i, token in enumerate(draft[:budget]):
        if token in eos_token_ids:
            return draft[: i + 1], FinishReason.STOP
    if len(draft) >= budget:
        return draft[:budget], FinishReason.LENGTH
    return draft, None
