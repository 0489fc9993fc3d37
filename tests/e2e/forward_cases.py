"""Paged KV for a few sequences of one model, to run forward rows by hand (the per-forward
parity tests and the native kernels' forward checks share it)."""

from __future__ import annotations

import torch

from engine.kv_pages import KVPages, PageGeometry, PageTables
from engine.model import DiffusionGemma, ForwardBatch, Mode, PagedKVCache, Row
from engine.model.config import LayerType
from kernels.reference import gather_pages

PAGE = 16


class Sequences:
    """Paged KV for a few sequences of one model, with helpers to run rows."""

    def __init__(self, model: DiffusionGemma, num_seqs: int, context: int) -> None:
        cfg = model.cfg
        geometry = PageGeometry(PAGE, cfg.sliding_window, context, True, True)
        full, ring = geometry.full_pages(context), geometry.sliding_ring(context)
        pages = KVPages(geometry, full * num_seqs, ring * num_seqs)
        self.tables: list[PageTables] = [pages.allocate(context) for _ in range(num_seqs)]
        sizes = {LayerType.FULL: full * num_seqs, LayerType.SLIDING: ring * num_seqs}
        self.cache = PagedKVCache(cfg, sizes, PAGE, model.embed_tokens.weight.dtype)
        self.model = model

    def row(self, seq: int, mode: Mode, start: int, num: int) -> Row:
        t = self.tables[seq]
        return Row(mode, start, num, {LayerType.FULL: t.full, LayerType.SLIDING: t.sliding()})

    def run(self, rows: list[Row], ids: torch.Tensor, soft: list | None = None) -> torch.Tensor:
        batch = ForwardBatch(rows, self.model.cfg.sliding_window, PAGE)
        return self.model(
            ids, soft or [None] * sum(r.mode is Mode.DECODE for r in rows), batch, self.cache
        )

    def cached(self, layer: int, seq: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.row(seq, Mode.DECODE, hi, 0).pages[self.cache.layer_types[layer]]
        k = gather_pages(self.cache.keys[layer], table, lo, hi)
        return k, gather_pages(self.cache.values[layer], table, lo, hi)
