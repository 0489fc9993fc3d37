"""The row-kind table: each kind of row (prefill, denoise, commit, AR, verify) says in one
place what it feeds the forward pass and what its step means for its request. Entries are
pure: they read the row and its result and return values (`EncodeInput`, `RowEffect`); the
scheduler's update alone applies an effect. A new kind (the hybrid mode's verify row was
one) is one new entry here and one scheduler state, not edits across the engine.

DENOISE rows are the only DECODE rows: their canvas ids and self-conditioning inputs come from
the sampler for all of them at once; every other kind is an ENCODE row that feeds tokens.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from engine.kv_pages import PageTables
from engine.request import RequestState, first_cut
from engine.runner import EncodeInput
from engine.types import FinishReason, RowEffect, RowKind, RowResult, ScheduledRow
from engine.vision_cache import ImageTokens


class RowSpec(Protocol):
    decode: bool  # a DECODE row (canvas from the sampler) rather than an ENCODE row

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        """ENCODE kinds: the tokens this row feeds."""

    def wants_token(self, row: ScheduledRow) -> bool:
        """The row's last position is sampled for the next token."""

    def effect(self, row: ScheduledRow, result: RowResult) -> RowEffect:
        """What the row's step means for its request (a value; nothing is written)."""


def _pages(row: ScheduledRow) -> PageTables:
    assert row.req.pages is not None
    return row.req.pages


class _EncodeRow:
    decode = False

    def wants_token(self, row: ScheduledRow) -> bool:
        return False

    def effect(self, row: ScheduledRow, result: RowResult) -> RowEffect:
        if result.token is None:
            return RowEffect(constraint=result.constraint)
        req, token = row.req, result.token
        reason = None
        if token in req.params.eos_token_ids:
            reason = FinishReason.STOP
        elif len(req.output_ids) + 1 >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        return RowEffect([token], result.logprobs, reason, constraint=result.constraint)


class PrefillRow(_EncodeRow):
    """Encoder over a prompt chunk; in AR mode the last chunk samples the first token."""

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        end = row.start + row.num_tokens
        tokens = row.req.prompt_ids[row.start : end]
        images = _image_tokens(row.req, row.start, end)
        spans = tuple((f, last) for f, last in row.req.image_spans if row.start <= f < end)
        return EncodeInput(
            row.start, tokens, _pages(row), self.wants_token(row), images=images, spans=spans
        )

    def wants_token(self, row: ScheduledRow) -> bool:
        end = row.start + row.num_tokens
        return row.req.params.mode.samples_tokens and end == row.req.num_prompt


def _image_tokens(req: RequestState, start: int, end: int) -> ImageTokens | None:
    """The image tokens among prompt positions [start, end), or None."""
    positions = req.image_positions
    lo, hi = bisect.bisect_left(positions, start), bisect.bisect_left(positions, end)
    if lo == hi:
        return None
    return ImageTokens(req.images, lo, tuple(p - start for p in positions[lo:hi]))


class CommitRow(_EncodeRow):
    """Encoder over a finished canvas: writes its KV."""

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        assert row.req.draft_to_commit is not None
        return EncodeInput(row.start, row.req.draft_to_commit, _pages(row), False)


class ArRow(_EncodeRow):
    """Encoder over the last sampled token; samples the next one."""

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        return EncodeInput(row.start, row.req.output_ids[-1:], _pages(row), True)

    def wants_token(self, row: ScheduledRow) -> bool:
        return True


class VerifyRow(_EncodeRow):
    """Hybrid: encoder over a draft that starts with the pending token (the last one
    committed). Its logits at every position accept the longest agreeing prefix of the draft
    plus one token of the verifier's (`engine.verify`); the KV of what was rejected is rolled
    back (not kept: the next pass overwrites it)."""

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        assert row.req.draft_to_commit is not None
        return EncodeInput(row.start, row.req.draft_to_commit, _pages(row), False, verify=True)

    def wants_token(self, row: ScheduledRow) -> bool:
        return True

    def effect(self, row: ScheduledRow, result: RowResult) -> RowEffect:
        assert result.tokens is not None
        req = row.req
        tokens, reason = first_cut(result.tokens, req.remaining, req.params.eos_token_ids)
        logprobs = result.logprobs[: len(tokens)] if result.logprobs is not None else None
        return RowEffect(
            tokens,
            logprobs,
            reason,
            constraint=result.constraint,
            num_kept=1 + result.num_accepted,
            accepted=result.num_accepted,
            verified=req.draft_to_commit[1:] if req.want_drafts and req.draft_to_commit else None,
        )


class DenoiseRow:
    """Decoder over the canvas: one denoising step; a finished canvas is cut and streamed,
    then committed if the request goes on."""

    decode = True

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        raise TypeError("DENOISE rows take their canvas from the sampler")

    def wants_token(self, row: ScheduledRow) -> bool:
        return False

    def effect(self, row: ScheduledRow, result: RowResult) -> RowEffect:
        req = row.req
        if not result.finished:
            draft = result.draft if req.want_drafts else None
            return RowEffect(draft=draft, constraint=result.constraint)
        assert result.draft is not None
        if req.is_hybrid:  # the draft goes to its verify pass, starting with the pending token
            draft = [req.pinned_token, *result.draft[1:]]
            return RowEffect(canvas_steps=result.num_steps, commit=draft)
        tokens, reason = first_cut(result.draft, req.remaining, req.params.eos_token_ids)
        logprobs = result.logprobs[: len(tokens)] if result.logprobs is not None else None
        return RowEffect(
            tokens,
            logprobs,
            reason,
            canvas_steps=result.num_steps,
            commit=result.draft if reason is None else None,
            constraint=result.constraint,
        )


ROW_KINDS: dict[RowKind, RowSpec] = {
    RowKind.PREFILL: PrefillRow(),
    RowKind.DENOISE: DenoiseRow(),
    RowKind.COMMIT: CommitRow(),
    RowKind.AR: ArRow(),
    RowKind.VERIFY: VerifyRow(),
}
