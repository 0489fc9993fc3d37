"""All-AR steps (fast numerics): steps whose rows each feed one token and want its logits (AR
requests, hybrid's AR part) take their inputs from persistent buffers per bucket of rows
(`engine.device.step_buffers`, `ForwardInputs(..., ar=True)`: the token ids, positions, rows
and page tables written in place from pinned mirrors), so a bucketed AR step allocates no
input, copies nothing from pageable memory and waits for nothing in its forward. With
`--cuda-graphs` its forward (and, in the buckets of at most `HEAD_ROWS` rows, the LM head) is
replayed from a graph per bucket (`engine.device.graphs.ForwardGraphs` over those buffers,
padded with dummy rows whose outputs are dropped), captured at warm-up with the canvases'
graphs, into their pool, or at a bucket's first step. The AR sampler runs eager.

Anything else runs as before (`engine.runner.ModelRunner`): steps with canvases, prompt chunks,
verify passes or images (mixed steps), steps of more rows than the largest bucket and exact
numerics' steps (one head GEMM per row there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from engine.device.graphs import Capture, ForwardGraphs, Hidden
from engine.device.overlap import ForwardClock
from engine.device.step_buffers import ForwardInputs
from engine.kv_pages import PageTables
from engine.model import DiffusionLM, PagedKVCache
from engine.model.kv_cache import DevicePageTables


class ArRow(Protocol):
    """An ENCODE row of a step (`engine.runner.EncodeInput`), as far as AR steps look."""

    @property
    def start(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def pages(self) -> PageTables: ...
    @property
    def wants_last_logits(self) -> bool: ...
    @property
    def verify(self) -> bool: ...
    @property
    def images(self) -> Any: ...
    @property
    def spans(self) -> tuple[tuple[int, int], ...]: ...


def is_ar(row: ArRow) -> bool:
    """One token whose logits are sampled: an AR row."""
    plain = not row.verify and row.images is None and not row.spans
    return len(row.tokens) == 1 and row.wants_last_logits and plain


class ArSteps:
    """The buckets of all-AR steps and their graphs (module docstring)."""

    def __init__(
        self,
        tables: DevicePageTables,
        model: DiffusionLM,
        cache: PagedKVCache,
        max_rows: int,
        capture: Capture | None,
    ) -> None:
        """`tables`: the runner's device page tables; `max_rows`: the largest bucket's rows;
        `capture`: the runner's (its canvases' graphs' pool), None: no graphs."""
        self.model, self.cache = model, cache
        self.inputs = ForwardInputs(tables, model, cache.page_size, max_rows, ar=True)
        self.graphs = ForwardGraphs(capture, self.inputs, model, cache) if capture else None

    def bucket(self, denoise: int, encode: Sequence[ArRow]) -> int | None:
        """The bucket of a step of `denoise` canvases and these ENCODE rows if it is an
        all-AR step that fits one in fast numerics, else None."""
        if denoise or not encode or self.model.kernels.exact:
            return None
        return self.inputs.bucket(len(encode)) if all(map(is_ar, encode)) else None

    def run(self, encode: Sequence[ArRow], bucket: int) -> tuple[torch.Tensor, ForwardClock]:
        """The logits [R, V] fp32 of an all-AR step of these R rows in `bucket`, and its
        forward's clock (stopped once the head is queued)."""
        starts, pages = [e.start for e in encode], [e.pages for e in encode]
        tokens, num = [e.tokens[0] for e in encode], len(encode)
        graphs = self.graphs
        fill = graphs.batch if graphs is not None else self.inputs.batch
        batch = fill(starts, pages, bucket, tokens=tokens)
        batch.prepare(self.inputs.tables.device, self.inputs.tables.pools)
        ids = self.inputs.ids(bucket)[:num]
        clock = ForwardClock(self.inputs.tables.device)
        forward: Hidden
        if graphs is not None:
            forward = graphs.run(ids, [], batch)
        else:
            forward = self.model(ids, [], batch, self.cache, None), self.model.logits
        hidden, head = forward
        logits = head(hidden[:num])
        clock.stop()
        return logits, clock
