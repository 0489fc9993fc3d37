"""The one state object of a request (torch-free): what it asked for, where the scheduler has
it, what it holds and what it has produced. Everyone may read it; only the scheduler writes it
(`engine.scheduler`: add, admission, the step's update, end), so a step that fails before its
update has changed nothing. Other structures hold the object itself (the scheduler's
`requests`, `waiting` and `running`), never a copy of its fields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from engine.kv_pages import PageTables
from engine.modes import ModePolicy, policy
from engine.params import ResolvedParams

if TYPE_CHECKING:
    from engine.inputs.images import PreparedImage
    from engine.logits.processors import PenaltyTokens
    from engine.structured import Constraint


class SeqState(str, Enum):
    """A request that is not running. A running one's state is the row kind it runs next
    (`engine.rows.ROW_KINDS`: `engine.types.RowKind` or a registered kind's name)."""

    WAITING = "waiting"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    context: int  # positions reserved: prompt + token budget rounded up to whole canvases
    canvas_length: int
    seed: int = 0  # the request's seed, or one drawn for it when it gave none
    want_drafts: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    # scheduling
    state: str = SeqState.WAITING  # or the kind of the next row (running)
    num_computed: int = 0  # positions whose KV is written
    # Prefix caching: `cache_key` joins the tokens in naming the KV (media hashes); the names
    # of the full pages known so far (the prompt's, then each completed one), how many are
    # registered, and how many prompt positions admission found cached.
    cache_key: str = ""
    page_names: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    num_cached: int = 0
    # What it holds while running: KV pages and a sampler slot (acquired at admission and
    # released at its end, together, by the scheduler).
    pages: PageTables | None = None
    slot: int | None = None
    # progress
    output_ids: list[int] = field(default_factory=list)
    draft_to_commit: list[int] = field(default_factory=list)  # a canvas to encode (COMMIT, VERIFY)
    in_canvas: bool = False  # a canvas is being denoised
    canvas_started: float = 0.0
    steps_per_canvas: list[int] = field(default_factory=list)
    decoder_passes: int = 0
    encoder_passes: int = 0
    verify_passes: int = 0  # hybrid
    accepted_tokens: int = 0  # hybrid: draft tokens accepted by the verifier
    # hybrid draft policy (`engine.draft_policy.DraftPolicy`): accepted draft tokens per verify
    # pass, averaged (None before the first), and AR tokens since the last verify pass
    accept_average: float | None = None
    tokens_since_draft: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    constraint: Constraint | None = None  # the request's grammar state (structured output)
    # image input: the images in prompt order, and the prompt positions of their image tokens
    # (the k-th takes the k-th soft token of the images in order)
    images: tuple[PreparedImage, ...] = ()
    image_positions: tuple[int, ...] = ()
    # (first, last) prompt positions of each image whose tokens attend to each other both ways
    # (use_bidirectional_attention "vision"; empty otherwise): each is computed in one pass
    image_spans: tuple[tuple[int, int], ...] = ()
    # the penalties' counts of its tokens, kept up to date as it commits (engine.logits)
    penalty_tokens: PenaltyTokens | None = None

    @property
    def remaining(self) -> int:
        """Tokens left in the budget."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def policy(self) -> ModePolicy:
        """The request's decode mode (`engine.modes`)."""
        return policy(self.params.mode)

    @property
    def pinned_token(self) -> int:
        """The token the next canvas holds in slot 0, or -1 (hybrid: the pending token, sampled
        by the encoder, its KV not yet written: the canvas's verify pass writes it)."""
        return self.policy.pinned_token(self)


def whole_images(spans: tuple[tuple[int, int], ...], start: int, num: int) -> int:
    """A prefill chunk of `num` tokens from `start`, cut so that it splits no image of `spans`
    (an image attended both ways needs all its keys in one pass): it ends before the first
    image it would split, or, when that image begins at `start`, at that image's end — past
    the step's token budget if need be, never past `max_prefill_chunk` (admission checked
    that every image fits one chunk; `engine.inputs.images.image_spans`)."""
    end = start + num
    for first, last in spans:
        if first < end <= last:
            return (first if first > start else last + 1) - start
    return num
