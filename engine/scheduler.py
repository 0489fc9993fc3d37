"""Step-level continuous batching and the one owner of a request's life (pure Python, no torch).

Each step the scheduler picks rows for one forward pass: for every running sequence one row —
a commit pass, a denoising step, an AR token or a prefill chunk — then admits waiting
sequences while pages, sampler slots and the row/token budgets allow. A sequence whose canvas
converged goes on to its commit pass at the next step; nothing waits for slower rows. A
diffusion request's commit pass takes the next canvas's first denoising step along in the
same forward (`first_step_along`): its second row.

A running request's state is the row kind it runs next: that kind plans its row, and the row's
effect names the state after it (`engine.rows`; what a mode changes is its policy's,
`engine.modes`). Built in: WAITING → PREFILL → (DENOISE → COMMIT → DENOISE …) | AR |
(DENOISE → VERIFY → DENOISE …) → FINISHED. Hybrid requests draft a canvas (DENOISE, a few
steps) and verify it (VERIFY: the encoder over the draft; the effect says how many of its
positions keep their KV — rolling the rest back is not advancing `num_computed` past them, and
the next pass overwrites them: a request's pages are reserved for its whole context at
admission, so nothing is freed or taken mid-request).

A request's life has four writers, all here: `add` (queued), admission in `schedule` (its KV
pages and sampler slot, acquired together), `update` (the step's effects, the only place
progress is written) and `end` (every way out — finish, failure, abort, drain — releases what
it holds exactly once). `check` verifies the accounting (free + held = capacity, every request
in exactly one place).

Prefix caching (`engine.kv_pages`, `engine.prefix_cache`): `add` names a prompt's full pages;
admission starts a request after the longest usable cached prefix (`num_cached`); `update`
names each page a request completes, so the next request can reuse it. A waiting request whose
first page a running request is still prefilling waits for it (`n > 1` choices, and requests
that share a system prompt, then compute it once).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from engine.draft_policy import PRIOR_DECAY, DraftPolicy, StepCost, decayed
from engine.kv_pages import CacheHit, IdPool, KVPages
from engine.prefix_cache import chain_hashes, root_hash
from engine.request import RequestState, SeqState
from engine.rows import ROW_KINDS, PlanContext
from engine.types import (
    PROGRESS_COUNTS,
    PROGRESS_VALUES,
    FinishReason,
    QueueFull,
    RequestStats,
    RowEffect,
    RowKind,
    ScheduledRow,
    StepOutput,
    StepPlan,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DraftPolicy",
    "InvariantError",
    "RowKind",
    "ScheduledRow",
    "Scheduler",
    "SchedulerConfig",
    "StepPlan",
]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences admitted (running) at once
    max_num_batched_tokens: int = 8192  # tokens per forward pass
    max_prefill_chunk: int = 2048  # prompt tokens per prefill row
    max_queue: int = 1024  # waiting sequences (beyond free running slots) before add() refuses
    draft_policy: DraftPolicy = DraftPolicy()

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class InvariantError(RuntimeError):
    """The scheduler's accounting is broken (a leak or a double release): a bug."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pages: KVPages,
        cache_salt: str = "",
        load_aware: bool = False,
    ) -> None:
        self.config = config
        self.pages = pages
        self.cache_salt = cache_salt  # what else names a page's KV: numerics, adapter
        # Hybrid drafting (`engine.draft_policy`): with `load_aware` (fast numerics), from the
        # measured step cost (the engine feeds `step_cost`) and every request's acceptance.
        self.load_aware = load_aware
        self.step_cost = StepCost()
        self.accept_prior: float | None = None
        # Prefix cache counters (tokens, since start): prompt tokens of admitted requests, and
        # of those, the ones found cached.
        self.num_queried_tokens = 0
        self.num_cached_tokens = 0
        self.slots = IdPool(config.max_num_seqs)  # sampler slots: one per running request
        self.requests: dict[str, RequestState] = {}  # every request known: waiting or running
        self.waiting: deque[RequestState] = deque()
        self.running: dict[str, RequestState] = {}  # admission order

    # -- a request's life ---------------------------------------------------------------------

    def add(self, seq: RequestState) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if not self.pages.fits_ever(seq.context):
            raise ValueError(f"a context of {seq.context} positions does not fit in the KV cache")
        capacity = self.config.max_num_seqs + self.config.max_queue
        if len(self.requests) >= capacity:
            raise QueueFull(
                f"{len(self.running)} requests running and {len(self.waiting)} waiting "
                f"(max_num_seqs + max_queue = {capacity})"
            )
        if self.pages.cache is not None:
            root = root_hash(self.cache_salt, seq.cache_key)
            seq.page_names = chain_hashes(root, seq.prompt_ids, self.pages.geometry.page_size)
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def _admit(
        self, seq: RequestState, now: float, hit: CacheHit | None, copies: list[tuple[int, int]]
    ) -> None:
        """Acquire what a running request holds (KV pages, a sampler slot), together; a cache
        hit's pages are shared and the window before them is copied (`copies`)."""
        pages = self.pages.allocate(seq.context, hit)
        try:
            (slot,) = self.slots.allocate(1)
        except MemoryError:
            self.pages.release(pages)
            raise
        self.waiting.popleft()
        seq.pages, seq.slot = pages, slot
        seq.state = RowKind.PREFILL
        seq.first_scheduled_time = now
        if hit is not None:
            copies += hit.copies(pages)
            seq.num_registered = hit.num_pages
            seq.num_computed = seq.num_cached = hit.num_pages * self.pages.geometry.page_size
        self.num_queried_tokens += seq.num_prompt if self.pages.cache is not None else 0
        self.num_cached_tokens += seq.num_cached
        self.running[seq.request_id] = seq

    def _waits_for_prefix(self, seq: RequestState) -> bool:
        """A running request is prefilling pages that begin the waiting `seq`'s prompt and are
        not cached yet: `seq` waits, then reuses them."""
        names = seq.page_names
        return any(
            r.num_computed < r.num_prompt  # still computing its prompt
            and r.num_registered < len(os.path.commonprefix([names, r.page_names]))
            for r in self.running.values()
        )

    def forget_history(self) -> None:
        """Forget what past steps taught (the step cost, the acceptance prior) and the prefix
        cache counters, as a fresh scheduler (after the warm-up's throwaway requests)."""
        self.step_cost, self.accept_prior = StepCost(), None
        self.num_queried_tokens = self.num_cached_tokens = 0

    def reset_prefix_cache(self) -> int:
        """Forget every cached page (running requests keep theirs); returns how many."""
        return self.pages.reset_cache()

    def end(self, seq_id: str) -> RequestState | None:
        """Remove a request (finished, failed or aborted) and release what it holds; None if
        it is not known (ended already)."""
        seq = self.requests.pop(seq_id, None)
        if seq is None:
            return None
        if self.running.pop(seq_id, None) is None:
            self.waiting.remove(seq)
        if seq.pages is not None:
            self.pages.release(seq.pages)
            seq.pages = None
        if seq.slot is not None:
            self.slots.release([seq.slot])
            seq.slot = None
        seq.state = SeqState.FINISHED
        return seq

    def fail(self, seq_id: str, error: str) -> StepOutput:
        """End a request with an error (its own: the others carry on): its last output."""
        self.end(seq_id)
        return StepOutput(seq_id, [], FinishReason.ABORT, error=error)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.requests)

    # -- planning -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        now = time.monotonic()
        rows: list[ScheduledRow] = []
        ended: list[StepOutput] = []
        copies: list[tuple[int, int]] = []
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running.values()):
            row = self._plan_row(seq, budget if rows else max(budget, 1), ended)
            if row is None:
                continue
            if rows and row.num_tokens > budget:
                continue  # does not fit this step; it keeps its place for the next
            budget = self._add(rows, row, budget - row.num_tokens)
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            hit = self.pages.find(seq.page_names, seq.num_prompt, seq.image_spans)
            if self._waits_for_prefix(seq) or not self.pages.can_allocate(seq.context, hit):
                break  # FCFS: later requests do not overtake the head of the queue
            try:
                self._admit(seq, now, hit, copies)
            except Exception as exc:  # its own fault: it ends, the queue moves on
                logger.exception("admitting request %s failed", seq.request_id)
                ended.append(self._fault(seq, "admission", exc))
                continue
            row = self._plan_row(seq, budget, ended, admitted=True)
            if row is not None:
                budget = self._add(rows, row, budget - row.num_tokens)
        return StepPlan(tuple(rows), now, tuple(ended), tuple(copies))

    @staticmethod
    def _add(rows: list[ScheduledRow], row: ScheduledRow, budget: int) -> int:
        """Append `row` and, where it ends the prefix of a diffusion request's next canvas,
        that canvas's first denoising step right after it; returns the budget left."""
        rows.append(row)
        follow = first_step_along(row)
        if follow is not None and follow.num_tokens <= budget:
            rows.append(follow)
            budget -= follow.num_tokens
        return budget

    def _plan_row(
        self, seq: RequestState, budget: int, ended: list[StepOutput], admitted: bool = False
    ) -> ScheduledRow | None:
        try:
            row = self.row_for(seq, budget, admitted)
            if row is not None and not ROW_KINDS[row.kind].decode and seq.pages is not None:
                self.pages.before_write(seq.pages, row.start, row.num_tokens)
            return row
        except Exception as exc:
            logger.exception("planning request %s failed", seq.request_id)
            ended.append(self._fault(seq, "scheduling", exc))
            return None

    def _fault(self, seq: RequestState, stage: str, exc: Exception) -> StepOutput:
        return self.fail(seq.request_id, f"internal engine error in {stage} ({type(exc).__name__})")

    def row_for(self, seq: RequestState, budget: int, admitted: bool) -> ScheduledRow | None:
        """The row `seq` runs next: its state's row kind plans it (`engine.rows`)."""
        context = PlanContext(budget, admitted, self.config.max_prefill_chunk, self._drafts)
        return ROW_KINDS[seq.state].plan(seq, context)

    def _drafts(self, seq: RequestState) -> bool:
        policy = self.config.draft_policy
        if not self.load_aware:
            return policy.drafts(seq, policy.canvas_cost)
        cost = self.step_cost.canvas_cost(seq.canvas_length, len(self.running))
        return policy.drafts(seq, cost or policy.canvas_cost, self.accept_prior)

    # -- the step's one update ----------------------------------------------------------------

    def update(
        self, plan: StepPlan, effects: Sequence[RowEffect], now: float | None = None
    ) -> list[StepOutput]:
        """Apply each row's effect to its request (the only place a step writes request
        state) and return the step's outputs; a request that finishes or fails ends here."""
        now = time.monotonic() if now is None else now
        outputs: list[StepOutput] = []
        for row, effect in zip(plan.rows, effects, strict=True):
            seq_id = row.seq_id
            if seq_id not in self.requests:
                continue  # aborted after the plan of a step run ahead (`engine.device.overlap`)
            try:
                out = (
                    self.fail(seq_id, effect.error)
                    if effect.error
                    else self._apply(row, effect, plan.time, now)
                )
            except Exception as exc:
                logger.exception("updating request %s failed", seq_id)
                out = self._fault(row.req, "update", exc)
            if out is not None:
                outputs.append(out)
        return outputs

    def _apply(
        self, row: ScheduledRow, effect: RowEffect, started: float, now: float
    ) -> StepOutput | None:
        """Apply one effect: its `Progress` field by field, then its tokens and its end."""
        seq, progress = row.req, effect.progress
        if effect.constraint is not None:
            seq.constraint = effect.constraint  # type: ignore[assignment]
        for name in PROGRESS_VALUES:
            value = getattr(progress, name)
            if value is not None:
                setattr(seq, name, value)
        for name in PROGRESS_COUNTS:
            setattr(seq, name, getattr(seq, name) + getattr(progress, name))
        if progress.starts_canvas:
            seq.canvas_started = started
        if progress.canvas_steps is not None:
            seq.steps_per_canvas.append(progress.canvas_steps)
        if effect.accepted is not None:
            self.accept_prior = decayed(self.accept_prior, effect.accepted, PRIOR_DECAY)
        if effect.tokens and seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids += effect.tokens
        self._name_pages(seq)
        accepted = effect.accepted if effect.verified is not None else None  # shown with it
        if effect.finish_reason is not None:
            self.end(seq.request_id)
            stats = request_stats(seq, now)
            return StepOutput(
                seq.request_id,
                effect.tokens,
                effect.finish_reason,
                None,
                stats,
                None,
                effect.logprobs,
                seq.num_cached,
                effect.verified,
                accepted,
            )
        if effect.tokens or effect.draft is not None:
            return StepOutput(
                seq.request_id,
                effect.tokens,
                draft=effect.draft,
                logprobs=effect.logprobs,
                num_cached_tokens=seq.num_cached,
                verified=effect.verified,
                accepted=accepted,
            )
        return None

    def _name_pages(self, seq: RequestState) -> None:
        """Register the pages `seq` has completed since the last time (prompt, then committed
        tokens: every position below `num_computed` holds the KV of prompt + output there)."""
        size = self.pages.geometry.page_size
        complete = seq.num_computed // size
        if self.pages.cache is None or complete <= seq.num_registered or seq.pages is None:
            return
        names = seq.page_names
        if len(names) < complete:
            tokens = seq.prompt_ids + seq.output_ids
            parent = names[-1] if names else root_hash(self.cache_salt, seq.cache_key)
            names += chain_hashes(parent, tokens[len(names) * size : complete * size], size)
        first = seq.num_registered
        self.pages.register(seq.pages, names[first:complete], first, seq.num_computed)
        seq.num_registered = complete

    # -- accounting ---------------------------------------------------------------------------

    def check(self) -> None:
        """Raise InvariantError unless every request is in exactly one place (waiting or
        running), only running ones hold pages and a slot, and for pages and slots free + held
        = capacity with nothing held twice."""
        waiting = [s.request_id for s in self.waiting]
        _require(len(set(waiting)) == len(waiting), "a request is queued twice")
        _require(not set(waiting) & set(self.running), "a request is both waiting and running")
        known = set(waiting) | set(self.running)
        _require(
            known == set(self.requests),
            f"requests known to one structure only: {sorted(known ^ set(self.requests))}",
        )
        _require(
            all(s.pages is None and s.slot is None for s in self.waiting),
            "a waiting request holds pages or a slot",
        )
        running = list(self.running.values())
        _require(
            all(s.pages is not None and s.slot is not None for s in running),
            "a running request lacks its pages or slot",
        )
        _check_pool("sampler slots", self.slots, [[s.slot] for s in running])  # type: ignore[list-item]
        holders = Counter(p for s in running for p in s.pages.full)  # type: ignore[union-attr]
        _require(dict(holders) == self.pages.refs, "full pages: reference counts != holders")
        rings = [p for s in running for p in s.pages.ring]  # type: ignore[union-attr]
        idle_full, idle_sliding = self.pages.idle_ids()
        # free + held + cached (idle) = capacity, nothing in two places
        _check_pool("full pages", self.pages.full, [list(holders), idle_full])
        _check_pool("sliding pages", self.pages.sliding, [rings, idle_sliding])
        cache = self.pages.cache
        if cache is not None:
            _require(
                set(cache.name_of_full) <= set(holders) | set(idle_full)
                and set(idle_full) <= set(cache.name_of_full),
                "full pages: a named page is neither held nor idle, or an idle one is unnamed",
            )
            _require(
                set(cache.name_of_sliding) <= set(rings) | set(idle_sliding)
                and set(idle_sliding) <= set(cache.name_of_sliding),
                "sliding pages: a named page is neither held nor idle, or an idle one is unnamed",
            )


def first_step_along(row: ScheduledRow) -> ScheduledRow | None:
    """The first denoising step of the canvas that begins where `row` ends, to run in the
    same forward pass, when `row` is a diffusion request's commit pass or its prompt's last
    prefill chunk; else None.

    It reads its prefix in the very forward that writes it: in every layer the ENCODE rows
    store their KV before any row attends, so the canvas sees the committed tokens' KV of
    that layer, the same values a later forward would read (exact numerics stay the
    reference's: every row's arithmetic is its own). One forward per canvas is saved — on a
    GPU at small batch, one pass over the weights. AR and hybrid requests sample their next
    token from the ENCODE pass (a hybrid draft starts with it), so they wait for it.

    The prompt's last chunk takes the first canvas along too: a request's first canvas
    starts in the forward that ends its prompt (one step fewer per request). Its fast-numerics
    rounding then depends on the other rows of that forward, as every fast row's does (a GEMM's
    last bits depend on its row count); exact numerics, whose rows' arithmetic is their own,
    give the reference's tokens as before (the parity and batch-invariance tests)."""
    seq = row.req
    if seq.policy.samples_tokens or not ROW_KINDS[row.kind].ends_prefix(row):
        return None
    end = row.start + row.num_tokens
    return ScheduledRow(seq, RowKind.DENOISE, end, seq.canvas_length, starts_canvas=True)


def request_stats(seq: RequestState, now: float) -> RequestStats:
    return RequestStats(
        num_prompt_tokens=len(seq.prompt_ids),
        num_output_tokens=len(seq.output_ids),
        decoder_passes=seq.decoder_passes,
        encoder_passes=seq.encoder_passes,
        steps_per_canvas=tuple(seq.steps_per_canvas),
        arrival_time=seq.arrival_time,
        first_scheduled_time=seq.first_scheduled_time,
        first_token_time=seq.first_token_time,
        finish_time=now,
        verify_passes=seq.verify_passes,
        accepted_tokens=seq.accepted_tokens,
        num_cached_tokens=seq.num_cached,
    )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvariantError(message)


def _check_pool(name: str, pool: IdPool, held: list[list[int]]) -> None:
    ids = [i for group in held for i in group]
    free = pool.free_ids()
    _require(len(set(ids)) == len(ids), f"{name}: an id is held twice")
    _require(not set(ids) & set(free), f"{name}: an id is both held and free")
    _require(
        len(ids) + len(free) == pool.num_pages,
        f"{name}: {len(free)} free + {len(ids)} held != {pool.num_pages}",
    )
