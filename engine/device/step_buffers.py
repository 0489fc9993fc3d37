"""Capture-ready inputs of all-denoise steps: every per-step input (the sampler's slots and
new-canvas flags; the forward's positions, rows and both pools' page tables) lives in a
persistent device buffer, one set per bucket of canvases (`bucket_sizes`), with a host mirror
(pinned on CUDA) written in place and copied in place (`copy_`, non-blocking). A bucketed step
then allocates no input, copies nothing from pageable memory and waits for nothing inside the
forward and the sampler, and every input sits at the same address at every step of its bucket:
what a CUDA graph replayed over them needs (`engine.device.graphs`).

A step of R canvases takes the smallest bucket B >= R. Rows R..B-1 are dummy rows (a canvas at
position 0, no prefix, every page -1): an eager step reads the first R rows (views of the
buffers), a replayed graph all B and drops the dummies' outputs. Steps with ENCODE rows
(mixed steps), steps of more canvases than the largest bucket and exact numerics' steps build
their inputs as before (`ModelRunner._batch`); a hybrid canvas's pinned first token, when a
step has one, is still copied by `to_device`.

All-AR steps (one new token per row: `engine.device.ar_steps`) have buckets of their own, of
rows (`ForwardInputs(..., ar=True)`): canvases of one token, ENCODE rows, whose token ids ride
in the int64 buffer too. Their dummy rows are flagged DECODE on the device only (a DECODE row
writes no KV: a dummy's pages are -1), so the host sees ENCODE rows and every kernel launch is
the same whatever the number of real rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.device.cuda import STAGING_OBSERVERS, host_buffer
from engine.kv_pages import PageTables
from engine.model.base import DiffusionLM
from engine.model.config import LayerType
from engine.model.kv_cache import DevicePageTables, ForwardBatch, Mode, Row
from kernels.reference import PagedRows


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """The buckets of steps of up to `max_rows` canvases: 1, 2, 4, ... below it, then it."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max(max_rows, 1))


def bucket_of(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `rows` canvases, None: more than the largest (or none)."""
    return next((size for size in sizes if size >= rows), None) if rows else None


class Mirrored:
    """A 1-D device buffer and its host mirror (pinned on CUDA; the buffer itself on a CPU),
    written on the host and copied to the device in place, without waiting. A write first waits
    for the last copy from the mirror to have run (it has, in a step loop that read the last
    step's results)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.host = host_buffer((size,), dtype, device)
        cpu = device.type == "cpu"
        self.device = self.host if cpu else torch.empty(size, dtype=dtype, device=device)
        self._copied: torch.cuda.Event | None = None

    def write(self, values: np.ndarray) -> None:
        """Set the whole buffer to `values` (its size) and queue the copy."""
        if self._copied is not None:
            self._copied.synchronize()
        self.host.numpy()[:] = values
        if self.device is self.host:
            return
        for observe in STAGING_OBSERVERS:  # a copy from staged memory (`engine.device.cuda`)
            observe(self.host)
        self.device.copy_(self.host, non_blocking=True)
        if self.device.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


class SamplerInputs:
    """The slots [B] and new-canvas flags [B] of the DENOISE rows, per bucket."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        self.sizes = bucket_sizes(max_rows)
        self._slots: dict[int, Mirrored] = {}
        self._flags: dict[int, Mirrored] = {}

    def stage(self, slots: list[int], starting: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [R] int64 and flags [R] bool on the device, views of the bucket's buffers
        (dummy rows: slot 0, not starting); more rows than the largest bucket: a buffer of
        their own number."""
        rows = len(slots)
        bucket = bucket_of(rows, self.sizes) or rows
        if bucket not in self._slots:
            self._slots[bucket] = Mirrored(bucket, torch.int64, self.device)
            self._flags[bucket] = Mirrored(bucket, torch.bool, self.device)
        pad = bucket - rows
        self._slots[bucket].write(np.array([*slots, *[0] * pad], dtype=np.int64))
        self._flags[bucket].write(np.array([*starting, *[False] * pad], dtype=np.bool_))
        return self._slots[bucket].device[:rows], self._flags[bucket].device[:rows]

    def buffers(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole of `bucket`'s slots [B] and flags [B] (dummy rows included), once staged."""
        return self._slots[bucket].device, self._flags[bucket].device


class BucketInputs:
    """One bucket's forward inputs: int64 [row index of B | positions B * L | AR: token ids B],
    int32 [start B | offset B | num_tokens B | decode B], and per pool the page tables
    [B, width]. `ar`: rows of one ENCODE token (L = 1), the dummy rows DECODE ones."""

    def __init__(
        self,
        bucket: int,
        length: int,
        pools: list[LayerType],
        width: int,
        device: torch.device,
        ar: bool = False,
    ) -> None:
        self.bucket, self.length, self.ar = bucket, length, ar
        self.longs = Mirrored(bucket * (1 + length + ar), torch.int64, device)
        self.ints = Mirrored(4 * bucket, torch.int32, device)
        self.pages = {
            t: torch.full((bucket, width), -1, dtype=torch.int32, device=device) for t in pools
        }
        parts = self.longs.device.split([bucket, bucket * length, bucket * ar])
        self.index, self.positions, self.ids = parts  # ids: [B] an AR bucket's tokens
        self.columns = self.ints.device.view(4, bucket)  # start, offset, num_tokens, decode

    def write(
        self, starts: list[int], rows: list[int], tables: DevicePageTables, tokens: list[int]
    ) -> None:
        """Rows `rows` of `tables` at `starts` (an AR bucket: with these `tokens`), then dummy
        rows; their page tables gathered."""
        bucket, length, real = self.bucket, self.length, len(starts)
        start = np.zeros(bucket, dtype=np.int64)
        start[:real] = starts
        index = np.full(bucket, rows[0] if rows else 0, dtype=np.int64)
        index[:real] = rows
        positions = (start[:, None] + np.arange(length, dtype=np.int64)).reshape(-1)
        ids = np.zeros(bucket if self.ar else 0, dtype=np.int64)
        ids[: len(tokens)] = tokens
        self.longs.write(np.concatenate([index, positions, ids]))
        offsets = np.arange(bucket, dtype=np.int64) * length
        ones = np.ones(bucket, dtype=np.int64)
        decode = (np.arange(bucket) >= real) if self.ar else ones  # AR: the dummies only
        columns = [start, offsets, ones * length, decode]
        self.ints.write(np.concatenate(columns).astype(np.int32))
        for t, pages in self.pages.items():  # the tables are as wide as the served context
            assert tables.table[t].shape[1] == pages.shape[1], "page tables wider than the model"
            torch.index_select(tables.table[t], 0, self.index, out=pages)
            if real < bucket:
                pages[real:].fill_(-1)

    def rows(self, starts: list[int], num: int) -> dict[LayerType, PagedRows]:
        """Each pool's paged rows over the first `num` rows (starts: the real rows')."""
        start, offset, count, decode = (c[:num] for c in self.columns)
        values = [*starts, *[0] * (num - len(starts))]
        ar, padded = self.ar, num > len(starts)  # an AR bucket's dummies: DECODE rows
        return {
            t: PagedRows(
                start, offset, count, decode, pages[:num], self.length, max(values), True,
                min(values), all_decode=not ar, no_decode=ar and not padded,
            )
            for t, pages in self.pages.items()
        }  # fmt: skip


class ForwardInputs:
    """The forward's inputs of all-denoise steps, per bucket (module docstring)."""

    def __init__(
        self,
        tables: DevicePageTables,
        model: DiffusionLM,
        page_size: int,
        max_rows: int,
        ar: bool = False,
    ) -> None:
        """`tables`: the runner's page tables of `model`'s KV pools of `page_size` pages;
        `ar`: the buckets of all-AR steps (of rows of one token) instead."""
        self.tables, self.ar = tables, ar
        self.length = 1 if ar else model.config.canvas_length
        self.window, self.page_size = model.cfg.sliding_window, page_size
        self.sizes = bucket_sizes(max_rows)
        self.buckets: dict[int, BucketInputs] = {}
        self._last: tuple[Any, ...] | None = None  # the last call's arguments and batch

    def bucket(self, rows: int) -> int | None:
        return bucket_of(rows, self.sizes)

    def ids(self, bucket: int) -> torch.Tensor:
        """An AR bucket's token ids [B], where `batch` wrote them (dummy rows: token 0)."""
        return self.buckets[bucket].ids

    def batch(
        self,
        starts: list[int],
        pages: list[PageTables],
        bucket: int,
        pad: bool = False,
        tokens: list[int] | None = None,
    ) -> ForwardBatch:
        """The forward batch of an all-denoise step of `len(starts)` canvases in `bucket` (at
        least as many; no rows: dummy rows only), or of an all-AR step of these rows and
        `tokens`: its inputs written into the bucket's buffers (`ids`: the AR tokens'); `pad`:
        with the dummy rows (the whole bucket), else the real rows only. All-denoise: the same
        rows as the last call's (a denoising canvas's next step), their tables unchanged and
        the device tables not placed since: that call's batch, as its buffers still hold it."""
        versions = [] if self.ar else [p.version for p in pages]
        key = (bucket, pad, starts, pages, versions, tokens)
        if self._last is not None and self._last[:-1] == (*key, self.tables.steps):
            return self._last[-1]
        inputs = self.buckets.get(bucket)
        if inputs is None:
            width, pools = self.tables.max_pages, self.tables.pools
            inputs = BucketInputs(bucket, self.length, pools, width, self.tables.device, self.ar)
            self.buckets[bucket] = inputs
        inputs.write(starts, self.tables.place(pages) if pages else [], self.tables, tokens or [])
        num = bucket if pad else len(starts)
        values = [*starts, *[0] * (num - len(starts))]
        mode = Mode.ENCODE if self.ar else Mode.DECODE
        rows = [Row(mode, s, self.length, {}) for s in values]
        batch = ForwardBatch(rows, self.window, self.page_size)
        device = self.tables.device
        batch.provide(device, inputs.positions[: num * self.length], inputs.rows(starts, num))
        if not self.ar:  # an AR step's tokens and positions are new every step
            self._last = (
                bucket,
                pad,
                list(starts),
                list(pages),
                versions,
                tokens,
                self.tables.steps,
                batch,
            )
        return batch
