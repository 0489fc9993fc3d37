"""CUDA graphs of all-denoise forwards (`canvas serve --cuda-graphs`, off by default): the
forward of a step whose rows are all DENOISE rows is captured once per bucket of canvases
(`engine.device.step_buffers.bucket_sizes`) over the bucket's persistent inputs and replayed,
so a step launches one graph instead of hundreds of kernels. In the buckets of at most
`HEAD_ROWS` canvases the LM head is captured too, and the sampler's device work around it
(`engine.device.sampler_graphs`): their graphs hold the bucket's fp32 logits, which the memory
plan counts (`engine.device.memory.graph_pool_bytes`); larger buckets run the head and sampler
eager (their launches weigh less in a longer step). Other steps with ENCODE rows than
all-AR ones (below) run eager.

A step of R canvases copies its canvas ids and self-conditioning inputs into the bucket's
static ones (rows past R zeroed: the dummy rows of `step_buffers`), unless the sampler's graph
wrote them there (`static_inputs`), writes the rest of its inputs into the bucket's buffers,
replays, and reads the first R rows' hidden states (or logits); the dummies' are dropped.
Capture (`ForwardGraphs.capture_all`, part of warm-up before ready): two warm runs, then the
capture, from the largest bucket down, every graph in one memory pool (the smaller ones reuse
the largest one's memory), up to the bucket of the plan's canvases per step. A bucket not
captured then is captured at its first step.

All-AR steps (one new token per row, `engine.device.ar_steps`) have graphs of their own, a
`ForwardGraphs` over the AR buckets of rows (`ForwardInputs(..., ar=True)`) in the same pool:
their static token ids are the bucket's input buffer (written in place with the other
inputs), they have no self-conditioning input, and in the buckets of at most `HEAD_ROWS` rows
the graph holds the head (the AR sampler runs eager).

The captured kernels must read every per-row value from the device: Triton's do (their grids
depend only on the rows' number and the canvas length, fixed per bucket); the twins size
tensors by host values (`PagedRows.max_start`), so graphs need the Triton kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.device.step_buffers import ForwardInputs, bucket_of
from engine.kv_pages import PageTables
from engine.model.base import DiffusionLM, SoftEmbeds
from engine.model.kv_cache import ForwardBatch, PagedKVCache

# Runs of the forward before its capture: the first compiles and allocates (cuBLAS workspaces,
# Triton's first launch), the second runs as the captured one will.
WARM_RUNS = 2
# The largest bucket whose graph holds the LM head and the sampler (module docstring).
HEAD_ROWS = 4

Outputs = tuple[torch.Tensor, ...]
# A forward's hidden states [N, H] and the head that gives their logits (`ForwardGraphs.run`).
Hidden = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


class Capture(Protocol):
    def capture(self, forward: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        """Run `forward` warm, then capture it: (replay, the outputs each replay rewrites)."""
        ...

    def apart(self) -> Capture:
        """A capture of the same kind whose graphs share a memory pool of their own."""
        ...


class CudaCapture:
    """CUDA graphs: warm runs on a side stream, then the capture, all in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"--cuda-graphs (cuda_graphs): CUDA graphs need a CUDA device, not {device}"
            )
        self.device = device
        self.pool: Any = None  # the graphs' memory pool (torch's handle), once one is captured

    def capture(self, forward: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARM_RUNS):
                forward()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, out

    def apart(self) -> CudaCapture:
        return CudaCapture(self.device)


def _done(logits: torch.Tensor) -> torch.Tensor:
    """The head of a step whose graph ran it: its output is the logits already."""
    return logits


@dataclass(slots=True)
class _Graph:
    ids: torch.Tensor  # [B * L] static canvas ids (AR: the bucket's token ids [B])
    soft: torch.Tensor | None  # [B * L, H] static self-conditioning inputs (AR: None)
    batch: ForwardBatch  # the step's batch (its device tensors are the bucket's buffers)
    replay: Callable[[], None] | None = None
    out: torch.Tensor | None = None  # [B * L, H] the hidden states (or [B * L, V] the logits)


class ForwardGraphs:
    """The captured forwards, one per bucket of `inputs` (module docstring)."""

    def __init__(
        self, capture: Capture, inputs: ForwardInputs, model: DiffusionLM, cache: PagedKVCache
    ) -> None:
        """`inputs`: the runner's buffers; `model` runs over `cache` (no images: canvases)."""
        self.capturer = capture
        self.inputs = inputs
        self.model, self.cache = model, cache
        self.hidden = model.embed_tokens.weight.shape[1]
        self.dtype = model.embed_tokens.weight.dtype
        self.graphs: dict[int, _Graph] = {}

    @torch.inference_mode()
    def capture_all(self, most: int | None = None) -> None:
        """Capture every bucket's forward not captured yet, the largest first, up to the bucket
        of `most` canvases (a step's most, which larger buckets would never serve; None: all):
        what the memory plan counts (`engine.device.memory.graph_pool_bytes`)."""
        sizes = self.inputs.sizes
        largest = (bucket_of(min(most, max(sizes)), sizes) if most else None) or max(sizes)
        for bucket in sorted((b for b in sizes if b <= largest), reverse=True):
            self._graph(bucket)

    def _graph(self, bucket: int) -> _Graph:
        graph = self.graphs.get(bucket)
        if graph is not None:
            return graph
        device, num = self.inputs.tables.device, bucket * self.inputs.length
        batch = self.inputs.batch([], [], bucket, pad=True)  # dummy rows only
        batch.prepare(device, self.inputs.tables.pools)
        if self.inputs.ar:
            ids, soft = self.inputs.ids(bucket), None
        else:
            ids = torch.zeros(num, dtype=torch.long, device=device)
            soft = torch.zeros(num, self.hidden, dtype=self.dtype, device=device)
        graph = self.graphs[bucket] = _Graph(ids, soft, batch)

        def forward() -> Outputs:
            soft: SoftEmbeds = [] if graph.soft is None else graph.soft  # AR rows: no canvas
            hidden = self.model(graph.ids, soft, graph.batch, self.cache, None)
            return (self.model.logits(hidden) if bucket <= HEAD_ROWS else hidden,)

        graph.replay, (graph.out,) = self.capturer.capture(forward)
        return graph

    def static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`bucket`'s static canvas ids [B * L] and self-conditioning inputs [B * L, H] (its
        graph captured first, if it was not): a step whose inputs are already there (written
        by the sampler's graph) copies nothing into them."""
        graph = self._graph(bucket)
        assert graph.soft is not None, "the canvas graphs' inputs"
        return graph.ids, graph.soft

    def logits(self, bucket: int) -> torch.Tensor | None:
        """The logits [B * L, V] that `bucket`'s graph writes (None: its head runs eager)."""
        graph = self.graphs.get(bucket)
        return graph.out if graph is not None and bucket <= HEAD_ROWS else None

    def batch(
        self,
        starts: list[int],
        pages: list[PageTables],
        bucket: int,
        tokens: list[int] | None = None,
    ) -> ForwardBatch:
        """An all-denoise (AR: all-AR, of these `tokens`) step's batch in `bucket`, padded to
        it, its inputs in the bucket's buffers (the bucket's graph captured first, if it was
        not)."""
        self._graph(bucket)  # a capture writes dummy rows into the buffers
        return self.inputs.batch(starts, pages, bucket, pad=True, tokens=tokens)

    def run(self, ids: torch.Tensor, soft: SoftEmbeds, batch: ForwardBatch) -> Hidden:
        """The hidden states [R * L, H] of an all-denoise step of R canvases and the head to
        apply to them, or, where the graph holds the head, the logits [R * L, V] and a head
        that returns them as they are: ids [R * L], soft [R * L, H] (AR: the ids where `batch`
        wrote them, soft unused); `batch`: what `ForwardGraphs.batch` gave for the step."""
        bucket = len(batch.rows)
        graph = self.graphs[bucket]
        graph.batch = batch
        num = ids.shape[0]
        if ids.data_ptr() != graph.ids.data_ptr():  # else written in place (`static_inputs`)
            assert isinstance(soft, torch.Tensor) and graph.soft is not None, "canvas inputs"
            graph.ids[:num].copy_(ids)
            graph.soft[:num].copy_(soft)
            if num < graph.ids.shape[0]:
                graph.ids[num:].zero_()
                graph.soft[num:].zero_()
        assert graph.replay is not None and graph.out is not None
        graph.replay()
        return graph.out[:num], _done if bucket <= HEAD_ROWS else self.model.logits
