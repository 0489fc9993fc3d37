"""A stand-in for CUDA graph capture (`engine.device.graphs.Capture`) shared by the graph
tests: its replay runs the eager function again, over whatever the bucket's buffers and batch
hold then, into the static outputs, so the padded, bucketed wiring runs without a graph."""

from __future__ import annotations

from collections.abc import Callable

from engine.device.graphs import ForwardGraphs, Outputs
from engine.device.sampler_graphs import SamplerGraphs
from engine.engine import Engine
from engine.sampling import BatchedSampling


class EagerCapture:
    def __init__(self) -> None:
        self.captured: list[int] = []  # rows of each captured function's first output, in order
        self.replays = 0
        self.parts: list[EagerCapture] = [self]  # this one and those `apart` made

    def capture(self, forward: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        outs = forward()
        self.captured.append(outs[0].shape[0] if outs else 0)

        def replay() -> None:
            self.replays += 1
            for out, new in zip(outs, forward(), strict=True):
                out.copy_(new)

        return replay, outs

    def apart(self) -> EagerCapture:
        other = EagerCapture()
        self.parts.append(other)
        return other


def fake_graphs(engine: Engine, capture: EagerCapture) -> None:
    """Give `engine` (fast numerics, built without `--cuda-graphs`) graphs that `capture` takes:
    the runner's forwards (all-denoise and all-AR steps') and the sampler's canvas inputs and
    update."""
    runner, sampling = engine.runner, engine.sampling
    assert isinstance(sampling, BatchedSampling)
    runner.graphs = ForwardGraphs(capture, runner.inputs, runner.model, runner.cache)
    runner.ar.graphs = ForwardGraphs(capture, runner.ar.inputs, runner.model, runner.cache)
    sampling.steps = SamplerGraphs(runner.graphs, sampling.sampler, sampling.inputs)
