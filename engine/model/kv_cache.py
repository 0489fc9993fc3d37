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
(`engine.kv_pages`); this module only moves tensors. Training has its own functional cache
(`engine.adapt.forward.TrainKVCache`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np
import torch

from engine.model.config import LayerType, TextConfig
from kernels import KernelSet
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
    # ENCODE rows: (first, last) positions of each run of new tokens that attend to each other
    # both ways (an image, on a checkpoint with use_bidirectional_attention "vision")
    spans: tuple[tuple[int, int], ...] = ()


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

    # A step's host metadata is a few small arrays, built with numpy: a torch op's dispatch
    # costs more than its work there, and every one of them gives up the GIL, which the HTTP
    # front end's thread may then hold for a while (the engine's overhead at AR steps).

    def row_of_token(self, device: torch.device) -> torch.Tensor:
        """[N] the row of each packed token."""
        return self._cached(
            ("row_of_token", device),
            lambda: torch.from_numpy(self._row_of_token()).to(device, non_blocking=True),
        )

    def _row_of_token(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.rows), dtype=np.int64), self.segments)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N] absolute positions of the packed tokens."""

        def build() -> torch.Tensor:
            shift = np.array([r.start - o for r, o in zip(self.rows, self.offsets, strict=True)])
            row = self._row_of_token()
            positions = shift[row] + np.arange(row.shape[0], dtype=np.int64)
            return torch.from_numpy(positions).to(device, non_blocking=True)

        return self._cached(("positions", device), build)

    def decode_index(self, device: torch.device) -> torch.Tensor:
        """[num_decode_tokens] packed indices of the DECODE rows' tokens (built on the host)."""
        return self._cached(
            ("decode_index", device),
            lambda: (
                self.decode_tokens(torch.device("cpu"))
                .nonzero()[:, 0]
                .to(device, non_blocking=True)
            ),
        )

    def decode_tokens(self, device: torch.device) -> torch.Tensor:
        """[N] bool: the token belongs to a DECODE row."""
        flags = torch.tensor([r.mode is Mode.DECODE for r in self.rows], dtype=torch.bool)
        return self._cached(
            ("decode_tokens", device),
            lambda: flags[self.row_of_token(torch.device("cpu"))].to(device, non_blocking=True),
        )

    def prepare(self, device: torch.device, layer_types: Iterable[LayerType]) -> None:
        """Build, and start moving to `device`, every tensor a forward asks of this batch (the
        positions, the DECODE rows' index and flags, the paged rows of each pool), so that the
        forward makes no host-to-device copy. Copies made on the host are non-blocking; the
        paged rows' are blocking, and a blocking copy waits for every queued kernel (a host
        synchronisation), so they are made here, before the step's forward is queued."""
        self.positions(device)
        modes = {row.mode for row in self.rows}
        if len(modes) > 1:  # a mixed batch: DECODE rows are gathered and flagged
            self.decode_index(device)
            self.decode_tokens(device)
        for layer_type in set(layer_types):
            self.paged_rows(layer_type, device)

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
                [r.pages[layer_type] for r in self.rows],
                device,
                self.span(),
            )
        return self._cache[key]  # type: ignore[return-value]

    def span(self) -> torch.Tensor | None:
        """[N, 2] (first, last) position each packed token also sees both ways: its run's
        (`Row.spans`), or (pos, pos); None when no row has a run (plain causal, no cost)."""
        if not any(r.spans for r in self.rows):
            return None

        def build() -> torch.Tensor:
            span = self.positions(torch.device("cpu"))[:, None].repeat(1, 2)  # [N, 2]
            for row, offset in zip(self.rows, self.offsets, strict=True):
                for first, last in row.spans:
                    assert row.start <= first <= last < row.start + row.num_tokens
                    lo = offset + first - row.start
                    span[lo : lo + last - first + 1] = torch.tensor([first, last])
            return span

        return self._cached(("span",), build)


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

    def copy_pages(self, layer_type: LayerType, src: list[int], dst: list[int]) -> None:
        """Copy pages src[i] -> dst[i] in every layer of `layer_type` (all sources are read
        before any destination is written)."""
        device = self.keys[0].device
        src_index = torch.tensor(src, dtype=torch.long, device=device)
        dst_index = torch.tensor(dst, dtype=torch.long, device=device)
        for layer, kind in enumerate(self.layer_types):
            if kind is layer_type:
                for pool in (self.keys[layer], self.values[layer]):
                    pool.index_copy_(0, dst_index, pool.index_select(0, src_index))
