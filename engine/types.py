"""The engine's contract with its callers (the server, the offline API, the scheduler's
users): torch-free types only, so that importing them never loads torch.

`EngineClient` is what the HTTP server needs from an engine: the async engine implements it,
and the server tests' fake engine does too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.inputs.images import PreparedImage
    from engine.params import ResolvedParams
    from engine.request import RequestState

__all__ = [
    "EngineClient",
    "EngineLimits",
    "EngineStats",
    "FinishReason",
    "Progress",
    "QueueFull",
    "RequestStats",
    "RowEffect",
    "RowKind",
    "ScheduledRow",
    "StepListener",
    "StepOutput",
    "StepPlan",
    "StepResult",
    "StepStats",
    "TokenLogprob",
    "tokens_per_forward",
]


class QueueFull(RuntimeError):
    """The waiting queue is full; retry later."""


class FinishReason(str, Enum):
    """Why a request ended; the values are the OpenAI `finish_reason` strings."""

    STOP = "stop"  # EOS, or a stop string (the server's)
    LENGTH = "length"  # the token budget
    ABORT = "abort"  # cancelled (client gone, shutdown)


@dataclass(frozen=True, slots=True)
class RequestStats:
    num_prompt_tokens: int
    num_output_tokens: int
    decoder_passes: int
    encoder_passes: int
    steps_per_canvas: tuple[int, ...]
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    verify_passes: int = 0  # hybrid: encoder passes over a draft (counted in encoder_passes)
    accepted_tokens: int = 0  # hybrid: draft tokens the verifier accepted
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def tokens_per_forward(self) -> float:
        return tokens_per_forward(
            self.num_output_tokens, self.decoder_passes, self.encoder_passes, self.verify_passes
        )


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A committed token's log-probability and the top alternatives at its position, most
    likely first (`engine.logprobs` defines the distribution)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step publishes for one request: committed tokens (never revised), the draft
    of an unfinished canvas (when asked for), and on the last output the finish reason."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    draft: list[int] | None = None
    stats: RequestStats | None = None
    error: str | None = None  # the request failed (finish_reason ABORT); the rest carry on
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (once run)
    # Hybrid, for a client that asked for drafts: a verify pass's proposals (the draft after
    # its pinned pending token) and how many of them the verifier accepted; the tokens this
    # output commits are those, then the verifier's own (which replaced proposal `accepted`).
    verified: list[int] | None = None
    accepted: int | None = None


# -- the step's values: plan → results → effects (scheduler ↔ engine ↔ row kinds) ---------------


class RowKind(str, Enum):
    """The built-in row kinds (`engine.rows.ROW_KINDS`; a registered kind's name may be any
    other string). A running request's state is the kind of the row it runs next."""

    PREFILL = "prefill"  # encoder over a prompt chunk
    DENOISE = "denoise"  # decoder over the canvas
    COMMIT = "commit"  # encoder over the finished canvas
    AR = "ar"  # encoder over the last sampled token
    VERIFY = "verify"  # hybrid: encoder over a draft, its logits accept a prefix of it


@dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One row of a step: a request's kind of pass over `num_tokens` new positions from
    `start`. It carries the request (read-only for everyone but the scheduler's update), so no
    one looks it up. `admitted`: the request's first row (its sampler slot is new);
    `starts_canvas`: a DENOISE row that begins a new canvas."""

    req: RequestState
    kind: str  # a key of `engine.rows.ROW_KINDS`
    start: int  # position of the first new token
    num_tokens: int
    admitted: bool = False
    starts_canvas: bool = False

    @property
    def seq_id(self) -> str:
        return self.req.request_id


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the scheduler planned: the rows of one forward pass, when, and the outputs of the
    requests it had to end while planning (a fault in their own planning or admission)."""

    rows: tuple[ScheduledRow, ...]
    time: float = 0.0  # time.monotonic() when planned
    ended: tuple[StepOutput, ...] = ()
    # (source, destination) sliding pages to copy before the forward: the cached window before
    # an admitted request's reuse point, into its own ring (`engine.kv_pages.CacheHit`)
    copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


@dataclass(frozen=True, slots=True)
class Progress:
    """How a row's step moves its request, as data; the scheduler's update applies it field
    by field (`PROGRESS_VALUES` are new values, None leaving the field as it is;
    `PROGRESS_COUNTS` are added). `state` is the row kind the request runs next;
    `draft_to_commit` [] means none. `starts_canvas`: a canvas begins (stamped with the plan's
    time); `canvas_steps`: one finished after that many steps."""

    state: str | None = None
    num_computed: int | None = None  # positions whose KV is written
    in_canvas: bool | None = None
    draft_to_commit: list[int] | None = None
    tokens_since_draft: int | None = None  # hybrid draft policy
    accept_average: float | None = None  # hybrid draft policy
    decoder_passes: int = 0
    encoder_passes: int = 0
    verify_passes: int = 0
    accepted_tokens: int = 0
    starts_canvas: bool = False
    canvas_steps: int | None = None


PROGRESS_VALUES = (
    "state",
    "num_computed",
    "in_canvas",
    "draft_to_commit",
    "tokens_since_draft",
    "accept_average",
)
PROGRESS_COUNTS = ("decoder_passes", "encoder_passes", "verify_passes", "accepted_tokens")


@dataclass(frozen=True, slots=True)
class RowEffect:
    """What a row's step means for its request, as a value (its row kind's verdict); the
    scheduler's update alone applies it. `tokens` are committed now (never revised); `draft`
    is an unfinished canvas's draft, for a client that asked; `accepted` and `verified`: a
    verify pass's accepted draft tokens and its proposals (the latter for a client that asked
    for drafts)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # the row failed: its request ends with this error, alone
    draft: list[int] | None = None
    constraint: object | None = None  # the request's grammar state after this row, when moved
    progress: Progress = Progress()
    accepted: int | None = None
    verified: list[int] | None = None


@dataclass(slots=True)
class StepStats:
    """Counters of the last step, for metrics and the overhead benchmark."""

    num_rows: int = 0
    num_tokens: int = 0
    num_committed: int = 0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0  # the sampler's arithmetic and its host transfer
    grammar_seconds: float = 0.0  # of which: grammars and log-probabilities (engine.postprocess)
    step_seconds: float = 0.0
    cpu_threads: int = 0  # the CPU thread count the step ran with (0: not set by the engine)
    canvas_latencies: list[float] = field(default_factory=list)  # committed canvases
    # Hybrid: per verify pass, the draft tokens accepted, and the draft tokens offered.
    accepted_lengths: list[int] = field(default_factory=list)
    num_drafted: int = 0
    row_kinds: dict[str, int] = field(default_factory=dict)  # rows run, by kind (engine.rows)
    # Overlapped steps (`engine.device.overlap`): its forward ran ahead, beside the last step's
    # update; forwards run ahead for it and dropped (its plan had other rows).
    ran_ahead: bool = False
    dropped_forwards: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step returns: its outputs (one per request it advanced that has
    something to say) and its counters."""

    outputs: list[StepOutput]
    stats: StepStats


def tokens_per_forward(
    num_tokens: int, decoder_passes: int, encoder_passes: int, verify_passes: int = 0
) -> float:
    """TPF: generated tokens per decoder pass (AR mode: per encoder pass; hybrid, which has
    verify passes: per model forward, decoder and encoder passes both counted)."""
    passes = decoder_passes + encoder_passes if verify_passes else decoder_passes or encoder_passes
    return num_tokens / passes if passes else 0.0


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What a request may ask of this engine, fixed when the engine is built.

    `max_fit_positions`: the longest context (prompt plus whole canvases) an empty KV cache
    holds, capped at `max_context_positions`; lets a caller check "does it fit the KV cache"
    without the cache itself. `max_inflight`: requests running plus waiting before QueueFull.
    """

    max_context_positions: int
    vocab_size: int
    canvas_length: int
    max_num_seqs: int
    max_inflight: int
    max_fit_positions: int
    numerics: str = "fast"  # "fast" | "exact"
    kernels: str = "twins"  # the bound backend's name: "twins" | "native" | "triton" | ...
    prefix_caching: bool = False  # complete prefix pages are reused across requests

    def __post_init__(self) -> None:
        if min(self.max_context_positions, self.vocab_size, self.canvas_length) < 1:
            raise ValueError("context positions, vocabulary and canvas length must be >= 1")
        if not 1 <= self.max_num_seqs <= self.max_inflight:
            raise ValueError("need 1 <= max_num_seqs <= max_inflight")
        if not 0 <= self.max_fit_positions <= self.max_context_positions:
            raise ValueError("max_fit_positions must be in [0, max_context_positions]")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine for /health, /ready and /metrics."""

    alive: bool  # the step loop is running
    healthy: bool  # alive, and stepping whenever there is work
    num_running: int
    num_waiting: int
    num_inflight: int  # requests between `generate` and their last output
    kv_usage: float  # 0..1
    num_steps: int
    num_slots_used: int = 0  # sampler slots held (= running requests when nothing leaks)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found cached
    prefix_cache_usage: float = 0.0  # 0..1: pages cached and idle (reclaimable)
    failure: str = ""  # why the engine stopped for good (a fatal CUDA error); "" while it runs
    warming_up: bool = False  # compiling kernels before ready (engine.device.warmup)


StepListener = Callable[[StepStats, list[StepOutput]], None]


class EngineClient(Protocol):
    """The engine as the server sees it. `generate` yields a request's outputs until the one
    with a finish reason, the first one empty once the engine has queued the request (what it
    refuses raises before: the server starts a response only after it); it raises ParamError
    (a request the engine cannot run, image tokens in `prompt_ids` that are not exactly its
    `images`' soft tokens included), QueueFull (too many in flight) or RuntimeError (an
    engine fault); closing the iterator early aborts the request. `on_step` listeners run on
    the engine's thread after every step that ran."""

    on_step: list[StepListener]

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def stats(self) -> EngineStats: ...

    def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        want_drafts: bool = False,
        images: tuple[PreparedImage, ...] = (),
    ) -> AsyncGenerator[StepOutput, None]: ...

    async def prepare(self, params: ResolvedParams) -> None:
        """Compile what a request needs before it is queued (its JSON schema's grammar, off
        the step loop and cached); ParamError naming `response_format` for a bad schema."""
        ...

    def abort(self, request_id: str) -> None: ...

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page (running requests keep theirs); returns how many
        pages were forgotten. RuntimeError when the step loop is not running."""
        ...

    def fail_all_inflight(self, error: Exception) -> int:
        """Fail every request in flight with `error` and abort it; returns how many (call on
        the event loop)."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...
