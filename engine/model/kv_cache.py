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

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np
import torch

from engine.device.cuda import host_buffer, to_device
from engine.kv_pages import PageTables
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
    # page table per pool (-1 = page released); empty when the batch has `page_tables`
    pages: dict[LayerType, list[int]]
    # ENCODE rows: (first, last) positions of each run of new tokens that attend to each other
    # both ways (an image, on a checkpoint with use_bidirectional_attention "vision")
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class ForwardBatch:
    """The rows of one forward pass and the derived, cached attention metadata."""

    rows: list[Row]
    sliding_window: int
    page_size: int
    # The rows' page tables on the device, [R, width] int32 per pool (`DevicePageTables`); None:
    # built from each row's `pages` lists
    page_tables: dict[LayerType, torch.Tensor] | None = None
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
            lambda: to_device(self._row_of_token(), device),
        )

    def _row_of_token(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.rows), dtype=np.int64), self.segments)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N] absolute positions of the packed tokens."""

        def build() -> torch.Tensor:
            shift = np.array([r.start - o for r, o in zip(self.rows, self.offsets, strict=True)])
            row = self._row_of_token()
            positions = shift[row] + np.arange(row.shape[0], dtype=np.int64)
            return to_device(positions, device)

        return self._cached(("positions", device), build)

    def decode_index(self, device: torch.device) -> torch.Tensor:
        """[num_decode_tokens] packed indices of the DECODE rows' tokens (built on the host)."""
        return self._cached(
            ("decode_index", device),
            lambda: to_device(np.flatnonzero(self._decode_tokens()), device),
        )

    def decode_tokens(self, device: torch.device) -> torch.Tensor:
        """[N] bool: the token belongs to a DECODE row."""
        return self._cached(
            ("decode_tokens", device), lambda: to_device(self._decode_tokens(), device)
        )

    def _decode_tokens(self) -> np.ndarray:
        flags = np.array([r.mode is Mode.DECODE for r in self.rows], dtype=np.bool_)
        return flags[self._row_of_token()]

    def provide(
        self, device: torch.device, positions: torch.Tensor, rows: dict[LayerType, PagedRows]
    ) -> None:
        """Take these tensors on `device` as the batch's positions and each pool's paged rows
        instead of building them (a caller's persistent buffers: `engine.device.step_buffers`)."""
        self._cache[("positions", device)] = positions
        for layer_type, paged in rows.items():
            self._cache[("paged_rows", layer_type, device)] = paged

    def prepare(self, device: torch.device, layer_types: Iterable[LayerType]) -> None:
        """Build, and start moving to `device`, every tensor a forward asks of this batch (the
        positions, the DECODE rows' index and flags, the paged rows of each pool), so that the
        forward makes no host-to-device copy. Every copy is non-blocking, from pinned memory
        on a GPU (`engine.device.cuda.to_device`), and is queued here, before the forward."""
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
            tables = self.page_tables
            self._cache[key] = PagedRows.build(
                [r.start for r in self.rows],
                [r.num_tokens for r in self.rows],
                [r.mode is Mode.DECODE for r in self.rows],
                tables[layer_type] if tables else [r.pages[layer_type] for r in self.rows],
                device,
                self.span(),
                lambda array: to_device(array, device),
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
        src_index = to_device(np.array(src, dtype=np.int64), device)
        dst_index = to_device(np.array(dst, dtype=np.int64), device)
        for layer, kind in enumerate(self.layer_types):
            if kind is layer_type:
                for pool in (self.keys[layer], self.values[layer]):
                    pool.index_copy_(0, dst_index, pool.index_select(0, src_index))


class DevicePageTables:
    """The page tables of the sequences a runner sees, kept on the device: per pool one
    [num_rows, max_pages] int32 table (-1 = no page) and its host mirror (pinned on a GPU).
    A sequence's `PageTables` keeps one row while it runs; the row is written again (on the
    host, then copied) only when the tables change (`PageTables.version`) or another sequence
    takes the row, so a step's host work grows with its rows, not with their context. Rows and
    columns grow when a step needs more; a row that no step used for longest is taken first."""

    def __init__(
        self,
        layer_types: Iterable[LayerType],
        device: torch.device,
        num_rows: int = 1,
        max_pages: int = 1,
    ) -> None:
        self.device = device
        self.pools = sorted(set(layer_types), key=lambda t: t.value)
        self.host: dict[LayerType, torch.Tensor] = {}  # [num_rows, max_pages] per pool
        self.table: dict[LayerType, torch.Tensor] = {}  # the same, on the device
        self._row_of: dict[PageTables, int] = {}
        self._held: list[tuple[PageTables, int] | None] = []  # row -> (tables, version)
        self._lengths: list[dict[LayerType, int]] = []  # row -> entries written per pool
        self._last_used: list[int] = []  # row -> the step that last used it
        self._step = 0
        self._copied: torch.cuda.Event | None = None  # after the last copies from the mirror
        self.rows_written = 0  # rows (re)written so far: a step's share is its tables' changes
        self._resize(num_rows, max_pages)

    def gather(self, pages: Sequence[PageTables]) -> dict[LayerType, torch.Tensor]:
        """The page tables of a step's rows (row i has `pages[i]`; a sequence may have several
        rows), per pool: [R, width] int32 on the device, width the longest table (at least 1),
        -1 past a row's end: the values `PagedRows.build` packs from the rows' lists."""
        index = to_device(np.array(self.place(pages), dtype=np.int64), self.device)
        out = {}
        for t in self.pools:
            width = max(1, max(_length(p, t) for p in pages))
            out[t] = self.table[t][:, :width].index_select(0, index)  # [R, width]
        return out

    def place(self, pages: Sequence[PageTables]) -> list[int]:
        """Give each of a step's sequences its row of `table`, up to date (copies queued, not
        waited for); returns the row of each of `pages`, in order."""
        self._step += 1
        widest = max((_length(p, t) for p in pages for t in self.pools), default=1)
        unique = list(dict.fromkeys(pages))
        num_rows, max_pages = len(self._held), self.max_pages
        if widest > max_pages or len(unique) > num_rows:
            rows = num_rows if len(unique) <= num_rows else max(len(unique), 2 * num_rows)
            self._resize(rows, max_pages if widest <= max_pages else max(widest, 2 * max_pages))
        if self._copied is not None:  # the last copies read the mirror: let them finish
            self._copied.synchronize()
            self._copied = None
        for p in unique:  # this step's rows are not taken from under it
            if p in self._row_of:
                self._last_used[self._row_of[p]] = self._step
        written = [self._row(p) for p in unique]
        if any(written):
            self._record_copies()
        return [self._row_of[p] for p in pages]

    @property
    def steps(self) -> int:
        """Calls of `place` so far (a row placed before the last one may have moved since)."""
        return self._step

    @property
    def max_pages(self) -> int:
        return self.host[self.pools[0]].shape[1]

    def _row(self, tables: PageTables) -> bool:
        """Give `tables` its row, up to date; returns whether it was written."""
        row = self._row_of.get(tables)
        if row is None:
            row = min(range(len(self._held)), key=self._last_used.__getitem__)
            held = self._held[row]
            if held is not None:
                del self._row_of[held[0]]
            self._row_of[tables] = row
        self._last_used[row] = self._step
        if self._held[row] == (tables, tables.version):
            return False
        self._held[row] = (tables, tables.version)
        self.rows_written += 1
        for t in self.pools:
            values = tables.full if t is LayerType.FULL else tables.sliding()
            old, new = self._lengths[row][t], len(values)
            mirror = self.host[t].numpy()
            mirror[row, :new] = values
            mirror[row, new:old] = -1
            self._lengths[row][t] = new
            end = max(old, new)
            if self.table[t] is not self.host[t] and end:
                self.table[t][row, :end].copy_(self.host[t][row, :end], non_blocking=True)
        return True

    def _record_copies(self) -> None:
        """Mark the copies queued from the mirror so far (a GPU's: they run later)."""
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _resize(self, num_rows: int, max_pages: int) -> None:
        """Grow to `num_rows` x `max_pages`, keeping every row written (the mirror is copied
        whole)."""
        cpu = self.device.type == "cpu"  # a CPU engine reads the mirror itself
        for t in self.pools:
            host = host_buffer((num_rows, max_pages), torch.int32, self.device).fill_(-1)
            if t in self.host:
                old = self.host[t]
                host[: old.shape[0], : old.shape[1]] = old
            self.host[t] = host
            self.table[t] = host if cpu else host.to(self.device, non_blocking=True)
        self._record_copies()
        grown = num_rows - len(self._held)
        self._held += [None] * grown
        self._lengths += [dict.fromkeys(self.pools, 0) for _ in range(grown)]
        self._last_used += [0] * grown


def _length(tables: PageTables, pool: LayerType) -> int:
    """The length of a pool's table (the sliding one's without building it)."""
    if pool is LayerType.FULL:
        return len(tables.full)
    return tables.num_logical if tables.ring else 0
