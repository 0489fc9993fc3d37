"""CUDA graphs for fixed batch buckets.

A denoising step launches hundreds of small kernels; at small batches the launch overhead is a
large share of the step. `GraphRunner` captures a callable once per bucket (a batch size along
dim 0 of every input) into a CUDA graph with persistent input buffers, and replays the smallest
bucket that fits: inputs are copied into the buffers' leading rows, the graph replays, and the
leading rows of the persistent output are returned. Larger batches run eagerly.

Contract for the captured callable: it treats rows along dim 0 independently (the padding rows
of a bucket hold stale data and their outputs are dropped), allocates nothing that must outlive
the call, and does not synchronise with the host. GPU only; the bucket choice is pure Python.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GraphBuckets:
    """Batch sizes with a captured graph, strictly ascending and positive."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ValueError("GraphBuckets.sizes must name at least one batch size")
        if any(s <= 0 for s in self.sizes):
            raise ValueError(f"GraphBuckets.sizes must be positive, got {self.sizes}")
        if any(a >= b for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError(f"GraphBuckets.sizes must be strictly ascending, got {self.sizes}")

    @staticmethod
    def powers_of_two(largest: int) -> GraphBuckets:
        """1, 2, 4, ... up to and including `largest` (added if not a power of two)."""
        sizes = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
        if sizes[-1] != largest:
            sizes.append(largest)
        return GraphBuckets(tuple(sizes))

    def pick(self, batch: int) -> int | None:
        """The smallest bucket holding `batch` rows, or None (run eagerly) when none does."""
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None


@dataclass(frozen=True, slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # persistent, [bucket, ...]
    output: torch.Tensor  # persistent, [bucket, ...]


class GraphRunner:
    """Replays `fn(*inputs)` from CUDA graphs captured per bucket (see the module docstring).

    `make_inputs(bucket)` returns example inputs of that batch size on the GPU; they become the
    persistent buffers. The returned output is a view of a persistent buffer: valid until the
    next call with the same bucket (clone it to keep it).
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        make_inputs: Callable[[int], Sequence[torch.Tensor]],
        buckets: GraphBuckets,
        warmup: int = 2,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("GraphRunner needs a CUDA GPU")
        self.fn = fn
        self.buckets = buckets
        self._graphs: dict[int, _Captured] = {}
        pool = torch.cuda.graph_pool_handle()  # buckets share one memory pool
        for bucket in reversed(buckets.sizes):  # largest first: the pool is sized once
            self._graphs[bucket] = self._capture(tuple(make_inputs(bucket)), warmup, pool)

    def _capture(self, inputs: tuple[torch.Tensor, ...], warmup: int, pool: object) -> _Captured:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (autotuning, lazy init) off the capture
            for _ in range(warmup):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = self.fn(*inputs)
        return _Captured(graph, inputs, output)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        batch = inputs[0].shape[0]
        bucket = self.buckets.pick(batch)
        if bucket is None:
            return self.fn(*inputs)
        captured = self._graphs[bucket]
        assert len(inputs) == len(captured.inputs), "same number of inputs as at capture"
        for buffer, x in zip(captured.inputs, inputs, strict=True):
            assert x.shape[1:] == buffer.shape[1:], "inputs differ from the capture beyond dim 0"
            buffer[:batch].copy_(x)
        captured.graph.replay()
        return captured.output[:batch]
