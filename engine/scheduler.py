"""Step-level continuous batching (pure Python, no torch).

Each step the scheduler picks rows for one forward pass: for every running sequence at most one
row — a commit pass, a denoising step, an AR token or a prefill chunk — then admits waiting
sequences while pages and the row/token budgets allow. A sequence whose canvas converged goes on
to its commit pass at the next step; nothing waits for slower rows.

States: WAITING → PREFILL → (DENOISE → COMMIT → DENOISE …) | AR → FINISHED.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

from engine.kv_pages import KVPages
from engine.request import RequestState, SeqState
from engine.types import QueueFull


class RowKind(str, Enum):
    PREFILL = "prefill"  # encoder over a prompt chunk
    DENOISE = "denoise"  # decoder over the canvas
    COMMIT = "commit"  # encoder over the finished canvas
    AR = "ar"  # encoder over the last sampled token


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences admitted (running) at once
    max_num_batched_tokens: int = 8192  # tokens per forward pass
    max_prefill_chunk: int = 2048  # prompt tokens per prefill row
    max_queue: int = 1024  # waiting sequences (beyond free running slots) before add() refuses

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One row of a step: a request's kind of pass over `num_tokens` new positions from
    `start`. It carries the request itself (its pages included), so no one looks it up."""

    req: RequestState
    kind: RowKind
    start: int  # position of the first new token
    num_tokens: int

    @property
    def seq_id(self) -> str:
        return self.req.request_id


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pages: KVPages) -> None:
        self.config = config
        self.pages = pages
        self.waiting: deque[RequestState] = deque()
        self.running: dict[str, RequestState] = {}  # admission order

    # -- membership ---------------------------------------------------------------------------

    def add(self, seq: RequestState) -> None:
        if not self.pages.fits_ever(seq.context):
            raise ValueError(f"a context of {seq.context} positions does not fit in the KV cache")
        capacity = self.config.max_num_seqs + self.config.max_queue
        if len(self.waiting) + len(self.running) >= capacity:
            raise QueueFull(
                f"{len(self.running)} requests running and {len(self.waiting)} waiting "
                f"(max_num_seqs + max_queue = {capacity})"
            )
        self.waiting.append(seq)

    def finish(self, seq_id: str) -> RequestState | None:
        """Remove a sequence (finished or aborted) and free its pages."""
        seq = self.running.pop(seq_id, None)
        if seq is None:
            for queued in self.waiting:
                if queued.request_id == seq_id:
                    self.waiting.remove(queued)
                    seq = queued
                    break
        if seq is not None:
            if seq.pages is not None:
                self.pages.release(seq.pages)
            seq.state = SeqState.FINISHED
        return seq

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- planning -----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        rows: list[ScheduledRow] = []
        budget = self.config.max_num_batched_tokens
        for seq in self.running.values():
            row = self._row_for(seq, budget if rows else max(budget, 1))
            if row is None:
                continue
            if rows and row.num_tokens > budget:
                continue  # does not fit this step; it keeps its place for the next
            rows.append(row)
            budget -= row.num_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.pages.can_allocate(seq.context):
                break  # FCFS: later requests do not overtake the head of the queue
            self.waiting.popleft()
            seq.pages = self.pages.allocate(seq.context)
            seq.state = SeqState.PREFILL
            self.running[seq.request_id] = seq
            row = self._row_for(seq, budget)
            if row is not None:
                rows.append(row)
                budget -= row.num_tokens
        return StepPlan(tuple(rows))

    def _row_for(self, seq: RequestState, budget: int) -> ScheduledRow | None:
        start = seq.num_computed
        if seq.state is SeqState.PREFILL:
            num = min(seq.num_prompt - start, self.config.max_prefill_chunk, budget)
            return ScheduledRow(seq, RowKind.PREFILL, start, num) if num > 0 else None
        if seq.state is SeqState.DENOISE:
            return ScheduledRow(seq, RowKind.DENOISE, start, seq.canvas_length)
        if seq.state is SeqState.COMMIT:
            return ScheduledRow(seq, RowKind.COMMIT, start, seq.canvas_length)
        if seq.state is SeqState.AR:
            return ScheduledRow(seq, RowKind.AR, start, 1)
        return None

    # -- feedback -----------------------------------------------------------------------------

    def on_row_done(self, row: ScheduledRow, canvas_finished: bool = False) -> None:
        """Advance a sequence after its row ran. `canvas_finished`: a DENOISE row's canvas
        converged and the request continues (so it needs a commit pass)."""
        seq = row.req
        if row.kind in (RowKind.PREFILL, RowKind.COMMIT, RowKind.AR):
            seq.num_computed = row.start + row.num_tokens
        if row.kind is RowKind.PREFILL and seq.num_computed == seq.num_prompt:
            seq.state = SeqState.AR if seq.is_ar else SeqState.DENOISE
        elif row.kind is RowKind.COMMIT:
            seq.state = SeqState.DENOISE
        elif row.kind is RowKind.DENOISE and canvas_finished:
            seq.state = SeqState.COMMIT
