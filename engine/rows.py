"""The row-kind registry: each kind of row (prefill, denoise, commit, AR, verify) owns its work
in one entry — the row it plans for a request in its state, what it feeds the forward pass,
the batched sampling of all its rows in a step, and what each row's step means for its request
(a `RowEffect` whose `Progress` carries the state change as data). The engine runs
"inputs → forward → for each kind present: sample its rows" and the scheduler's update applies
effects without knowing kinds, so a new kind is one `register` call and its own code
(`tests/unit/test_extension.py` registers a toy one).

A running request's state is the kind of the row it runs next. DECODE kinds take their canvas
from the sampler (the canvas inputs of all of them at once); the others are ENCODE kinds that
feed tokens (`encode_input`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engine.draft_policy import ACCEPT_DECAY, decayed
from engine.kv_pages import PageTables
from engine.modes import first_cut
from engine.postprocess import (
    CanvasResult,
    TokenResult,
    ar_results,
    before_sampling,
    denoise_results,
)
from engine.request import RequestState, whole_images
from engine.runner import EncodeInput
from engine.sampling import CanvasBatch, Sampling
from engine.types import Progress, RowEffect, RowKind, ScheduledRow, StepStats
from engine.verify import Verified, verify_draft
from engine.vision_cache import ImageTokens

Install = Callable[[list[bool]], None]  # store the sampler state of the rows flagged ok


@dataclass(frozen=True, slots=True)
class PlanContext:
    """What a kind's planning may consult besides the request: the step's token budget left,
    whether the request was just admitted, the prefill chunk and the hybrid draft policy
    (`engine.draft_policy`)."""

    budget: int
    admitted: bool
    max_prefill_chunk: int
    drafts: Callable[[RequestState], bool]


@dataclass(frozen=True, slots=True)
class KindBatch:
    """The rows of one kind in a step, in plan order, and what the forward gave them.
    `logits`: DECODE kinds: [R * L, V] fp32 of these rows; ENCODE kinds: [R_w, V] at the last
    position of the rows that `wants_token`, in order. `verify_logits`: [L, V] per row of a
    kind whose inputs ask for every position (`EncodeInput.verify`)."""

    rows: list[ScheduledRow]
    sampling: Sampling
    stats: StepStats
    logits: torch.Tensor | None = None
    canvas: CanvasBatch | None = None
    verify_logits: tuple[torch.Tensor, ...] = ()


class RowSpec(Protocol):
    decode: bool  # a DECODE row (canvas from the sampler) rather than an ENCODE row

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        """The row a request in this kind's state runs next (None: none fits the budget)."""

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        """ENCODE kinds: the tokens this row feeds."""

    def wants_token(self, row: ScheduledRow) -> bool:
        """The row's last position is sampled for the next token."""

    def ends_prefix(self, row: ScheduledRow) -> bool:
        """The row writes the last KV before a new canvas (its first step may ride along)."""

    def sample(self, batch: KindBatch) -> tuple[list[RowEffect], Install]:
        """Every row's effect (in order; nothing written) and how to store the sampler state
        of the rows that succeeded."""


def _pages(row: ScheduledRow) -> PageTables:
    assert row.req.pages is not None
    return row.req.pages


def _nothing(ok: list[bool]) -> None:
    pass


class EncodeRow:
    """An encoder pass over tokens (the base of the ENCODE kinds): it writes the KV of its
    positions; a row that `wants_token` commits the token sampled at its last position."""

    decode = False

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        raise NotImplementedError

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        raise NotImplementedError

    def wants_token(self, row: ScheduledRow) -> bool:
        return False

    def ends_prefix(self, row: ScheduledRow) -> bool:
        return False

    def progress(self, row: ScheduledRow) -> Progress:
        """The row's own move of its request (without a token's)."""
        return Progress(num_computed=row.start + row.num_tokens, encoder_passes=1)

    def sample(self, batch: KindBatch) -> tuple[list[RowEffect], Install]:
        want = [self.wants_token(row) for row in batch.rows]
        if not any(want):
            return [self.effect(row, None) for row in batch.rows], _nothing
        reqs = [row.req for row, w in zip(batch.rows, want, strict=True) if w]
        sampling, stats = batch.sampling, batch.stats
        begin = time.perf_counter()
        raw = before_sampling(reqs, batch.logits)  # a grammar masks the logits in place
        masked = time.perf_counter()
        assert batch.logits is not None
        sampled = sampling.sample_tokens(batch.logits, reqs)
        drawn = time.perf_counter()
        results = iter(ar_results(reqs, sampled, raw))
        stats.grammar_seconds += (masked - begin) + (time.perf_counter() - drawn)
        effects = [
            self.effect(row, next(results) if w else None)
            for row, w in zip(batch.rows, want, strict=True)
        ]

        def install(ok: list[bool]) -> None:
            sampling.install(sampled, [k for k, w in zip(ok, want, strict=True) if w])

        return effects, install

    def effect(self, row: ScheduledRow, result: TokenResult | None) -> RowEffect:
        """A row's effect from the token sampled at its last position (None: it sampled none)."""
        progress = self.progress(row)
        if result is None:
            return RowEffect(progress=progress)
        if result.error is not None:
            return RowEffect(error=result.error)
        req = row.req
        tokens, reason = first_cut([result.token], req.remaining, req.params.eos_token_ids)
        return RowEffect(
            tokens, result.logprobs, reason, constraint=result.constraint, progress=progress
        )


class PrefillRow(EncodeRow):
    """Encoder over a prompt chunk; in a mode that samples tokens the last chunk samples the
    first token."""

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        start = seq.num_computed
        num = min(seq.num_prompt - start, ctx.max_prefill_chunk, ctx.budget)
        num = whole_images(seq.image_spans, start, num)
        return ScheduledRow(seq, RowKind.PREFILL, start, num, ctx.admitted) if num > 0 else None

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        end = row.start + row.num_tokens
        tokens = row.req.prompt_ids[row.start : end]
        images = _image_tokens(row.req, row.start, end)
        spans = tuple((f, last) for f, last in row.req.image_spans if row.start <= f < end)
        return EncodeInput(
            row.start, tokens, _pages(row), self.wants_token(row), images=images, spans=spans
        )

    def wants_token(self, row: ScheduledRow) -> bool:
        return row.req.policy.samples_tokens and self.ends_prefix(row)

    def ends_prefix(self, row: ScheduledRow) -> bool:
        return row.start + row.num_tokens == row.req.num_prompt

    def progress(self, row: ScheduledRow) -> Progress:
        progress = EncodeRow.progress(self, row)
        if self.ends_prefix(row):
            return replace(progress, state=row.req.policy.after_prefill)
        return progress


def _image_tokens(req: RequestState, start: int, end: int) -> ImageTokens | None:
    """The image tokens among prompt positions [start, end), or None."""
    positions = req.image_positions
    lo, hi = bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)
    if lo == hi:
        return None
    return ImageTokens(req.images, lo, tuple(p - start for p in positions[lo:hi]))


class CommitRow(EncodeRow):
    """Encoder over a finished canvas: writes its KV; the next canvas follows."""

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        return ScheduledRow(seq, RowKind.COMMIT, seq.num_computed, seq.canvas_length, ctx.admitted)

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        assert row.req.draft_to_commit, "a commit pass without its canvas"
        return EncodeInput(row.start, row.req.draft_to_commit, _pages(row), False)

    def ends_prefix(self, row: ScheduledRow) -> bool:
        return True

    def progress(self, row: ScheduledRow) -> Progress:
        progress = EncodeRow.progress(self, row)
        return replace(progress, state=RowKind.DENOISE, draft_to_commit=[])


class ArRow(EncodeRow):
    """Encoder over the last sampled token; samples the next one."""

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        return ScheduledRow(seq, RowKind.AR, seq.num_computed, 1, ctx.admitted)

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        return EncodeInput(row.start, row.req.output_ids[-1:], _pages(row), True)

    def wants_token(self, row: ScheduledRow) -> bool:
        return True

    def progress(self, row: ScheduledRow) -> Progress:
        progress = EncodeRow.progress(self, row)
        return replace(progress, tokens_since_draft=row.req.tokens_since_draft + 1)


class VerifyRow(EncodeRow):
    """Hybrid: encoder over a draft that starts with the pending token (the last one
    committed). Its logits at every position accept the longest agreeing prefix of the draft
    plus one token of the verifier's (`engine.verify`); the KV of what was rejected is rolled
    back (not kept: the next pass overwrites it)."""

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        return ScheduledRow(seq, RowKind.VERIFY, seq.num_computed, seq.canvas_length, ctx.admitted)

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        assert row.req.draft_to_commit, "a verify pass without its draft"
        return EncodeInput(row.start, row.req.draft_to_commit, _pages(row), False, verify=True)

    def sample(self, batch: KindBatch) -> tuple[list[RowEffect], Install]:
        reqs = [row.req for row in batch.rows]
        sampling = batch.sampling
        draws = sampling.verify_draws(reqs)
        verified = [
            verify_draft(req, req.draft_to_commit, logits, rng)
            for req, logits, rng in zip(reqs, batch.verify_logits, draws, strict=True)
        ]
        effects = [self.judged(row, v) for row, v in zip(batch.rows, verified, strict=True)]
        return effects, lambda ok: sampling.install_draws(reqs, draws, ok)

    def judged(self, row: ScheduledRow, result: Verified) -> RowEffect:
        """A row's effect from what its verify pass accepted."""
        if result.error is not None:
            return RowEffect(error=result.error)
        req, accepted = row.req, result.num_accepted
        tokens, reason = first_cut(result.tokens, req.remaining, req.params.eos_token_ids)
        logprobs = result.logprobs[: len(tokens)] if result.logprobs is not None else None
        progress = Progress(
            state=RowKind.DENOISE,
            num_computed=row.start + 1 + accepted,  # the pending token and the accepted ones
            draft_to_commit=[],
            tokens_since_draft=0,
            accept_average=decayed(req.accept_average, accepted, ACCEPT_DECAY),
            encoder_passes=1,
            verify_passes=1,
            accepted_tokens=accepted,
        )
        return RowEffect(
            tokens,
            logprobs,
            reason,
            constraint=result.constraint,
            progress=progress,
            accepted=accepted,
            verified=req.draft_to_commit[1:] if req.want_drafts else None,
        )


class DenoiseRow:
    """Decoder over the canvas: one denoising step; what a converged canvas becomes is its
    mode's answer (`ModePolicy.finish_canvas`: cut and streamed, then committed; or verified).
    Between canvases the mode may take an encoder token first (hybrid: an AR row)."""

    decode = True

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        start = seq.num_computed
        if not seq.in_canvas and not seq.policy.starts_canvas(seq, ctx.drafts):
            return ScheduledRow(seq, RowKind.AR, start, 1, ctx.admitted)
        return ScheduledRow(
            seq, RowKind.DENOISE, start, seq.canvas_length, ctx.admitted, not seq.in_canvas
        )

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        raise TypeError("DENOISE rows take their canvas from the sampler")

    def wants_token(self, row: ScheduledRow) -> bool:
        return False

    def ends_prefix(self, row: ScheduledRow) -> bool:
        return False

    def sample(self, batch: KindBatch) -> tuple[list[RowEffect], Install]:
        reqs = [row.req for row in batch.rows]
        sampling, logits = batch.sampling, batch.logits
        assert batch.canvas is not None and logits is not None
        sampled = sampling.sample_canvases(batch.canvas, logits, reqs)
        begin = time.perf_counter()
        results = denoise_results(reqs, sampled, logits)
        batch.stats.grammar_seconds += time.perf_counter() - begin
        effects = [self.effect(row, r) for row, r in zip(batch.rows, results, strict=True)]
        return effects, lambda ok: sampling.install(sampled, ok)

    def effect(self, row: ScheduledRow, result: CanvasResult) -> RowEffect:
        """A row's effect from its denoising step."""
        if result.error is not None:
            return RowEffect(error=result.error)
        req = row.req
        progress = Progress(
            decoder_passes=1,
            starts_canvas=row.starts_canvas,
            in_canvas=True if row.starts_canvas else None,
        )
        draft = result.draft
        if not result.finished:
            draft = draft if req.want_drafts else None
            return RowEffect(draft=draft, constraint=result.constraint, progress=progress)
        assert draft is not None
        progress = replace(progress, in_canvas=False, canvas_steps=result.num_steps)
        effect = req.policy.finish_canvas(req, draft, result.logprobs, progress)
        return replace(effect, constraint=result.constraint)


ROW_KINDS: dict[str, RowSpec] = {
    RowKind.PREFILL: PrefillRow(),
    RowKind.DENOISE: DenoiseRow(),
    RowKind.COMMIT: CommitRow(),
    RowKind.AR: ArRow(),
    RowKind.VERIFY: VerifyRow(),
}


def register(name: str, spec: RowSpec) -> None:
    """Add a row kind (a mode's `after_prefill`, or another kind's `Progress.state`, names it)."""
    if name in ROW_KINDS:
        raise ValueError(f"row kind {name!r} is registered already")
    ROW_KINDS[name] = spec
