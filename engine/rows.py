"""The row-kind table: each kind of row (prefill, denoise, commit, AR) says in one place what it
feeds the forward pass and what happens after its step. A new kind (e.g. a verify row) is one
new entry here and one scheduler state, not edits across the engine.

DENOISE rows are the only DECODE rows: their canvas ids and self-conditioning inputs come from
the sampler for all of them at once; every other kind is an ENCODE row that feeds tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv_pages import PageTables
from engine.params import DecodeMode
from engine.request import first_cut
from engine.runner import EncodeInput
from engine.scheduler import RowKind, ScheduledRow
from engine.types import StepOutput, TokenLogprob

if TYPE_CHECKING:
    from engine.engine import Engine


@dataclass(frozen=True, slots=True)
class RowResult:
    """What the sampler produced for one row."""

    token: int | None = None  # ENCODE rows that sample the next token (AR)
    finished: bool = False  # DENOISE: the canvas converged or hit the step cap
    num_steps: int = 0  # DENOISE: steps taken by the canvas so far
    draft: list[int] | None = None  # DENOISE: the argmax canvas (finished or asked for)
    failed: bool = False  # the row's logits were not finite: its request fails alone
    logprobs: list[TokenLogprob] | None = None  # per token (AR) or per draft position


class RowSpec(Protocol):
    decode: bool  # a DECODE row (canvas from the sampler) rather than an ENCODE row

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        """ENCODE kinds: the tokens this row feeds."""

    def wants_token(self, row: ScheduledRow) -> bool:
        """The row's last position is sampled for the next token."""

    def after(self, engine: Engine, row: ScheduledRow, result: RowResult) -> list[StepOutput]:
        """Book-keeping and outputs once the row's step ran."""


def _pages(row: ScheduledRow) -> PageTables:
    assert row.req.pages is not None
    return row.req.pages


class _EncodeRow:
    decode = False

    def wants_token(self, row: ScheduledRow) -> bool:
        return False

    def after(self, engine: Engine, row: ScheduledRow, result: RowResult) -> list[StepOutput]:
        row.req.encoder_passes += 1
        engine.scheduler.on_row_done(row)
        if result.token is None:
            return []
        return [engine.emit_token(row.req, result.token, result.logprobs)]


class PrefillRow(_EncodeRow):
    """Encoder over a prompt chunk; in AR mode the last chunk samples the first token."""

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        tokens = row.req.prompt_ids[row.start : row.start + row.num_tokens]
        return EncodeInput(row.start, tokens, _pages(row), self.wants_token(row))

    def wants_token(self, row: ScheduledRow) -> bool:
        end = row.start + row.num_tokens
        return row.req.params.mode is DecodeMode.AR and end == row.req.num_prompt


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


class DenoiseRow:
    """Decoder over the canvas: one denoising step; a finished canvas is cut and streamed,
    then committed if the request goes on."""

    decode = True

    def encode_input(self, row: ScheduledRow) -> EncodeInput:
        raise TypeError("DENOISE rows take their canvas from the sampler")

    def wants_token(self, row: ScheduledRow) -> bool:
        return False

    def after(self, engine: Engine, row: ScheduledRow, result: RowResult) -> list[StepOutput]:
        req = row.req
        req.decoder_passes += 1
        if not result.finished:
            engine.scheduler.on_row_done(row)
            if req.want_drafts and result.draft is not None:
                return [StepOutput(req.request_id, [], draft=result.draft)]
            return []
        assert result.draft is not None
        req.steps_per_canvas.append(result.num_steps)
        engine.note_canvas_latency(time.monotonic() - req.canvas_started)
        req.in_canvas = False
        tokens, reason = first_cut(result.draft, req.remaining, req.params.eos_token_ids)
        if reason is None:
            req.draft_to_commit = result.draft
            engine.scheduler.on_row_done(row, canvas_finished=True)
        logprobs = result.logprobs[: len(tokens)] if result.logprobs is not None else None
        return [engine.emit(req, tokens, reason, logprobs)]


ROW_KINDS: dict[RowKind, RowSpec] = {
    RowKind.PREFILL: PrefillRow(),
    RowKind.DENOISE: DenoiseRow(),
    RowKind.COMMIT: CommitRow(),
    RowKind.AR: ArRow(),
}
