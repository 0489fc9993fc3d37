"""Paged KV storage and the per-forward batch metadata.

A forward pass runs over *rows*; each row is one request's new tokens in one of two modes:
ENCODE (causal, writes its KV: a prefill chunk, a commit pass, an AR token) or DECODE
(bidirectional over a canvas, reads the prefix KV read-only). Tokens of all rows are packed into
one sequence for the per-token work (projections, MLPs, experts); attention runs per row.

Every attention layer sees, for each row, its cached prefix keys (the last `sliding_window - 1`
positions on sliding layers, all of them on full layers — exactly the keys the reference's
DynamicCache holds) followed by the row's own new keys.

A cache runs attention (`KVCache.attend`). The serving cache is paged: KV lives in fixed-size
pages of `page_size` positions, one pool per layer type (sliding layers keep only their window,
so their pool is smaller), and every layer writes the ENCODE rows' KV, then runs one paged
canvas-attention call over all rows. Page tables come from the scheduler's allocator
(`engine.kv_pages`); this module only moves tensors. `TrainKVCache` is training's functional
cache (autograd flows through it), one row at a time, never used for serving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from engine.model.config import LayerType, TextConfig
from kernels import KernelSet
from kernels.reference import PagedRows, attention


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

    def _cached(self, key: tuple[object, ...], build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]  # type: ignore[return-value]

    def row_of_token(self, device: torch.device) -> torch.Tensor:
        """[N] the row of each packed token."""
        return self._cached(
            ("row_of_token", device),
            lambda: torch.repeat_interleave(
                torch.arange(len(self.rows)), torch.tensor(self.segments, dtype=torch.long)
            ).to(device),
        )

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N] absolute positions of the packed tokens."""

        def build() -> torch.Tensor:
            row = self.row_of_token(torch.device("cpu"))
            starts = torch.tensor(
                [r.start - o for r, o in zip(self.rows, self.offsets, strict=True)]
            )
            return (starts[row] + torch.arange(row.shape[0])).to(device)

        return self._cached(("positions", device), build)

    def decode_index(self, device: torch.device) -> torch.Tensor:
        """[num_decode_tokens] packed indices of the DECODE rows' tokens (built on the host)."""
        return self._cached(
            ("decode_index", device),
            lambda: self.decode_tokens(torch.device("cpu")).nonzero()[:, 0].to(device),
        )

    def decode_tokens(self, device: torch.device) -> torch.Tensor:
        """[N] bool: the token belongs to a DECODE row."""
        flags = torch.tensor([r.mode is Mode.DECODE for r in self.rows], dtype=torch.bool)
        return self._cached(
            ("decode_tokens", device),
            lambda: flags[self.row_of_token(torch.device("cpu"))].to(device),
        )

    @property
    def segments(self) -> list[int]:
        """Tokens per row, in packing order."""
        return [r.num_tokens for r in self.rows]

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


class KVCache(Protocol):
    """Where a layer's KV lives and how its attention runs."""

    def attend(
        self,
        kernels: KernelSet,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """Write the ENCODE rows' new k, v ([N, Hkv, D]) and attend every row's queries
        q [N, Hq, D] over its prefix and its new keys (window 0: full layer). [N, Hq, D]."""
        ...


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

    def attend(
        self,
        kernels: KernelSet,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """See `KVCache.attend`: one `write_kv` and one `canvas_attention` over all rows."""
        rows = batch.paged_rows(self.layer_types[layer], q.device)
        k_pool, v_pool = self.keys[layer], self.values[layer]
        kernels.write_kv(k, v, k_pool, v_pool, rows)
        return kernels.canvas_attention(q, k, v, k_pool, v_pool, rows, window, scale)


class TrainKVCache:
    """KV storage for training and scoring: functional (no in-place writes), so gradients flow
    from the decoder's loss back through the prefix keys into the encoder. Attention runs one
    row at a time with an explicit mask (the reference's order). Each row's sequence is named
    by the first entry of its full-attention page table (any unique int)."""

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def _seq(row: Row) -> int:
        return row.pages[LayerType.FULL][0]

    def attend(
        self,
        kernels: KernelSet,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """See `KVCache.attend`."""
        parts = []
        for row, offset in zip(batch.rows, batch.offsets, strict=True):
            new = slice(offset, offset + row.num_tokens)
            row_k, row_v = k[new].transpose(0, 1), v[new].transpose(0, 1)  # [Hkv, T, D]
            if row.mode is Mode.ENCODE:
                self._write(layer, row, row_k, row_v)
            lo = max(0, row.start - (window - 1)) if window > 0 else 0
            prefix_k, prefix_v = self._gather(layer, row, lo, row.start)
            keys = torch.cat([prefix_k, row_k[None]], dim=2)
            values = torch.cat([prefix_v, row_v[None]], dim=2)
            mask = _row_mask(row, lo, window, q.device)
            out = attention(q[new].transpose(0, 1)[None], keys, values, mask, scale)
            parts.append(out[0].transpose(0, 1))
        return torch.cat(parts)

    def _write(self, layer: int, row: Row, k: torch.Tensor, v: torch.Tensor) -> None:
        key = (layer, self._seq(row))
        if key in self._kv:
            old_k, old_v = self._kv[key]
            k = torch.cat([old_k[:, : row.start], k], dim=1)
            v = torch.cat([old_v[:, : row.start], v], dim=1)
        elif row.start != 0:
            raise ValueError(f"sequence {key[1]}: first write must start at position 0")
        self._kv[key] = (k, v)

    def _gather(self, layer: int, row: Row, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, self._seq(row))
        if key not in self._kv:
            raise KeyError(f"sequence {key[1]} has no cached prefix on layer {layer}")
        k, v = self._kv[key]
        return k[None, :, lo:hi], v[None, :, lo:hi]


def _row_mask(row: Row, lo: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [1, 1, T, S + T] over a row's keys (its cached range from `lo`, then its
    new tokens), or None when every query sees every key (DECODE rows)."""
    if row.mode is Mode.DECODE:
        return None  # the canvas sees all of its prefix range and all of itself
    key_pos = torch.cat(
        [torch.arange(lo, row.start), torch.arange(row.start, row.start + row.num_tokens)]
    )
    q_pos = torch.arange(row.start, row.start + row.num_tokens)[:, None]
    mask = key_pos[None, :] <= q_pos
    if window > 0:
        mask &= key_pos[None, :] > q_pos - window
    return mask[None, None].to(device)
