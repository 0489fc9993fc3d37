"""Model runner: turns a step plan into tensors, runs one forward pass, returns logits.

It owns the model and the paged KV pools. Per row it needs the tokens to feed (prompt chunk,
canvas, committed draft, last AR token) and, for canvases, the self-conditioning input; it
returns the logits the sampler needs: every canvas position of DENOISE rows and the last
position of rows that end a prompt or carry an AR token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.kv_pages import PageTables
from engine.model import DiffusionLM, ForwardBatch, Mode, PagedKVCache
from engine.model.config import LayerType
from engine.model.kv_cache import Row
from engine.scheduler import RowKind, ScheduledRow


@dataclass(frozen=True, slots=True)
class RowInput:
    """What the runner feeds for one scheduled row."""

    row: ScheduledRow
    tokens: list[int] | torch.Tensor  # [num_tokens]
    pages: PageTables
    soft_embeds: torch.Tensor | None = None  # DENOISE rows: [L, H] or None on the first step
    wants_last_logits: bool = False  # ENCODE rows whose last position is sampled (AR)


@dataclass(frozen=True, slots=True)
class RunOutput:
    denoise_logits: torch.Tensor | None  # [R, L, V] fp32, DENOISE rows in plan order
    last_logits: dict[int, torch.Tensor]  # row index -> [V] fp32
    forward_seconds: float


class ModelRunner:
    def __init__(self, model: DiffusionLM, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.embed_tokens.weight.device

    @torch.inference_mode()
    def execute(self, inputs: list[RowInput]) -> RunOutput:
        batch = ForwardBatch(
            rows=[self._row(i) for i in inputs],
            sliding_window=self.model.cfg.sliding_window,
            page_size=self.cache.page_size,
        )
        ids = torch.cat([torch.as_tensor(i.tokens, dtype=torch.long) for i in inputs]).to(
            self.device
        )
        soft = [i.soft_embeds for i in inputs if i.row.kind is RowKind.DENOISE]
        start = time.perf_counter()
        hidden = self.model(ids, soft, batch, self.cache)  # [N, H]
        spans = [(o, i.row.num_tokens) for o, i in zip(batch.offsets, inputs, strict=True)]
        denoise = [s for s, i in zip(spans, inputs, strict=True) if i.row.kind is RowKind.DENOISE]
        denoise_logits = None
        if denoise:
            length = denoise[0][1]
            if len(denoise) == len(inputs):
                rows_hidden = hidden
            else:
                rows_hidden = torch.cat([hidden[o : o + n] for o, n in denoise])
            denoise_logits = self.model.logits(rows_hidden).view(len(denoise), length, -1)
        last = {
            k: self.model.logits(hidden[o + n - 1])
            for k, ((o, n), i) in enumerate(zip(spans, inputs, strict=True))
            if i.wants_last_logits
        }
        return RunOutput(denoise_logits, last, time.perf_counter() - start)

    def _row(self, inp: RowInput) -> Row:
        mode = Mode.DECODE if inp.row.kind is RowKind.DENOISE else Mode.ENCODE
        return Row(
            mode=mode,
            start=inp.row.start,
            num_tokens=inp.row.num_tokens,
            pages={LayerType.FULL: inp.pages.full, LayerType.SLIDING: inp.pages.sliding()},
        )
