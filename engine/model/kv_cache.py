"""Paged KV storage and the per-forward batch metadata.

A forward pass runs over *rows*; each row is one request's new tokens in one of two modes:
ENCODE (causal, writes its KV: a prefill chunk, a commit pass, an AR token) or DECODE
(bidirectional over a canvas, reads the prefix KV read-only). Tokens of all rows are packed into
one sequence for the per-token work (projections, MLPs, experts); attention runs per row.

Every attention layer sees, for each row, its cached prefix keys (the last `sliding_window - 1`
positions on sliding layers, all of them on full layers — exactly the keys the reference's
DynamicCache holds) followed by the row's own new keys.

The cache is paged: KV lives in fixed-size pages of `page_size` positions, one pool per layer
type (sliding layers keep only their window, so their pool is smaller). Page tables come from
the scheduler's allocator (`engine.kv_pages`); this module only moves tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.model.config import LayerType, TextConfig
from kernels.reference import PagedRows


class Mode(str, Enum):
    ENCODE = "encode"  # causal over the new tokens, writes their KV (prefill, commit, AR)
    DECODE = "decode"  # bidirectional over the canvas, reads the prefix KV read-only


@dataclass(frozen=True, slots=True)
class Row:
    """One request's new tokens in a forward pass."""

    mode: Mode
    start: int  # prefix length: position of the first new token
    num_tokens: int
    pages: dict[LayerType, list[int]]  # page table per pool (-1 = page released)


@dataclass(slots=True)
class ForwardBatch:
    """The rows of one forward pass and the derived, cached attention metadata."""

    rows: list[Row]
    sliding_window: int
    page_size: int
    offsets: list[int] = field(default_factory=list)  # packed token offset of each row
    _cache: dict[object, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        total = 0
        self.offsets = []
        for row in self.rows:
            self.offsets.append(total)
            total += row.num_tokens

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N] absolute positions of the packed tokens."""
        key = ("positions", device)
        if key not in self._cache:
            parts = [torch.arange(r.start, r.start + r.num_tokens) for r in self.rows]
            self._cache[key] = torch.cat(parts).to(device)
        return self._cache[key]  # type: ignore[return-value]

    @property
    def segments(self) -> list[int]:
        """Tokens per row, in packing order."""
        return [r.num_tokens for r in self.rows]

    def key_range(self, row: Row, sliding: bool) -> tuple[int, int]:
        """[lo, hi) of cached prefix positions this row reads on a layer type."""
        lo = max(0, row.start - (self.sliding_window - 1)) if sliding else 0
        return lo, row.start

    def paged_rows(self, layer_type: LayerType, device: torch.device) -> PagedRows:
        """The rows as the paged attention kernels see them, with one pool's page tables."""
        key = ("paged_rows", layer_type, device)
        if key not in self._cache:
            self._cache[key] = PagedRows.build(
                [r.start for r in self.rows],
                [r.num_tokens for r in self.rows],
                [r.mode is Mode.DECODE for r in self.rows],
                [list(r.pages[layer_type]) for r in self.rows],
                device,
            )
        return self._cache[key]  # type: ignore[return-value]

    def mask(self, index: int, sliding: bool, device: torch.device) -> torch.Tensor | None:
        """Boolean mask [1, 1, T, S + T] over a row's keys (its cached range, then its new
        tokens), or None when every query sees every key (DECODE rows)."""
        key = ("mask", index, sliding, device)
        if key not in self._cache:
            self._cache[key] = self._build_mask(self.rows[index], sliding, device)
        return self._cache[key]  # type: ignore[return-value]

    def _build_mask(self, row: Row, sliding: bool, device: torch.device) -> torch.Tensor | None:
        if row.mode is Mode.DECODE:
            return None  # the canvas sees all of its prefix range and all of itself
        lo, hi = self.key_range(row, sliding)
        key_pos = torch.cat(
            [torch.arange(lo, hi), torch.arange(row.start, row.start + row.num_tokens)]
        )
        q_pos = torch.arange(row.start, row.start + row.num_tokens)[:, None]
        mask = key_pos[None, :] <= q_pos
        if sliding:
            mask &= key_pos[None, :] > q_pos - self.sliding_window
        return mask[None, None].to(device)


class PagedKVCache:
    """KV pools: per layer [num_pages, Hkv, page_size, D]; pages are shared by rows via tables."""

    def __init__(
        self,
        config: TextConfig,
        num_pages: dict[LayerType, int],
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.page_size = page_size
        self.layer_types = [spec.layer_type for spec in config.layers]
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for spec in config.layers:
            shape = (num_pages[spec.layer_type], spec.num_kv_heads, page_size, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))

    def write(self, layer: int, row: Row, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a row's new k, v ([Hkv, T, D]) at positions row.start.. of its pages."""
        table = row.pages[self.layer_types[layer]]
        size = self.page_size
        pos, end = row.start, row.start + row.num_tokens
        while pos < end:
            page, offset = table[pos // size], pos % size
            n = min(size - offset, end - pos)
            src = slice(pos - row.start, pos - row.start + n)
            self.keys[layer][page, :, offset : offset + n] = k[:, src]
            self.values[layer][page, :, offset : offset + n] = v[:, src]
            pos += n

    def gather(self, layer: int, row: Row, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached k, v of positions [lo, hi) of a row: [1, Hkv, hi - lo, D]."""
        pool_k, pool_v = self.keys[layer], self.values[layer]
        if hi <= lo:
            shape = (1, pool_k.shape[1], 0, pool_k.shape[3])
            return pool_k.new_zeros(shape), pool_v.new_zeros(shape)
        size = self.page_size
        first = lo // size
        pages = row.pages[self.layer_types[layer]][first : (hi + size - 1) // size]
        index = torch.tensor(pages, device=pool_k.device)
        k = self._flatten(pool_k.index_select(0, index))
        v = self._flatten(pool_v.index_select(0, index))
        return k[:, :, lo - first * size : hi - first * size], v[
            :, :, lo - first * size : hi - first * size
        ]

    @staticmethod
    def _flatten(pages: torch.Tensor) -> torch.Tensor:
        """[P, Hkv, page, D] -> [1, Hkv, P*page, D]."""
        num_pages, heads, size, dim = pages.shape
        return pages.transpose(0, 1).reshape(1, heads, num_pages * size, dim)


class TrainKVCache:
    """KV storage for training: functional (no in-place writes), so gradients flow from the
    decoder's loss back through the prefix keys into the encoder. Each row's sequence is named
    by the first entry of its full-attention page table (any unique int)."""

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _seq(row: Row) -> int:
        return row.pages[LayerType.FULL][0]

    def write(self, layer: int, row: Row, k: torch.Tensor, v: torch.Tensor) -> None:
        key = (layer, self._seq(row))
        if key in self._kv:
            old_k, old_v = self._kv[key]
            k = torch.cat([old_k[:, : row.start], k], dim=1)
            v = torch.cat([old_v[:, : row.start], v], dim=1)
        elif row.start != 0:
            raise ValueError(f"sequence {key[1]}: first write must start at position 0")
        self._kv[key] = (k, v)

    def gather(self, layer: int, row: Row, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, self._seq(row))
        if key not in self._kv:
            raise KeyError(f"sequence {key[1]} has no cached prefix on layer {layer}")
        k, v = self._kv[key]
        return k[None, :, lo:hi], v[None, :, lo:hi]
