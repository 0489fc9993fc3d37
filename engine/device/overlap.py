"""Overlapped steps, and step timing that lets the host run ahead of the device.

Overlapped steps: the forward and sampler of step t run on a worker thread while the step
loop hands step t-1's outputs over (its listeners, its publishing, its counters).

    loop thread:    begin t ─ submit ─ hand over t-1 ─ wait ─ finish t ─ begin t+1 ─ ...
    worker thread:                   └─ execute t (forward, sampler) ─┘

`Engine.begin` and `Engine.finish` write the scheduler's state, `Engine.execute` only the
runner's and the sampler's, so the hand-over (which reads a finished step's values and the
scheduler's counters) may run beside it; commands (new requests, aborts) are still taken
between `finish` and the next `begin`. PyTorch's operators and the native kernels release the
interpreter lock, so the hand-over and the server's front end, which wakes up to stream what was
handed over, run while the forward computes instead of between two steps. The steps themselves
are the serial loop's, in the same order, so the tokens are too (`tests/e2e/test_overlap.py`).

Exact numerics never overlap: their loop stays the serial one it is checked against.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.device.cuda import select_device
from engine.types import StepResult

if TYPE_CHECKING:
    from engine.engine import Engine

HandOver = Callable[[StepResult], None]


class StepPipeline:
    """Steps an engine, each step's result handed to `hand_over` once, in step order: at once
    (serial), or while the next step's forward runs (overlapped; `flush` hands over the last
    one when no step follows)."""

    def __init__(self, engine: Engine, overlap: bool) -> None:
        self.engine = engine
        self.overlap = overlap and not engine.model.kernels.exact
        self._worker: ThreadPoolExecutor | None = None
        self._held: StepResult | None = None  # the last step's result, not handed over yet
        if self.overlap:  # the worker launches kernels: on the engine's device (select_device)
            self._worker = ThreadPoolExecutor(
                1, "canvas-forward", initializer=select_device, initargs=(engine.device,)
            )

    @property
    def holding(self) -> bool:
        """A finished step waits to be handed over."""
        return self._held is not None

    def step(self, hand_over: HandOver) -> None:
        """One engine step. What it raises (`Engine.step`) comes after the last step's result
        was handed over; the step that raised hands nothing over."""
        engine = self.engine
        if self._worker is None:
            hand_over(engine.step())
            return
        try:
            began = engine.begin()
            running = self._worker.submit(engine.execute, began) if began.plan.rows else None
        finally:
            self.flush(hand_over)  # while the forward runs
        effects = running.result() if running is not None else []
        self._held = engine.finish(began, effects)

    def flush(self, hand_over: HandOver) -> None:
        """Hand the held result over, if there is one."""
        held, self._held = self._held, None
        if held is not None:
            hand_over(held)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)


class ForwardClock:
    """A step's forward time and its sampler's after it. On CUDA between events, read once the
    sampler has read its results to the host (so they are done: no `synchronize`, and the host
    may run ahead of the device); elsewhere the host's clock. Started when made."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[torch.cuda.Event] = []
        self._times: list[float] = []
        self._mark()

    def _mark(self) -> None:
        if self.cuda:
            self._marks.append(torch.cuda.Event(enable_timing=True))
            self._marks[-1].record()
        else:
            self._times.append(time.perf_counter())

    def stop(self) -> None:
        """The forward is queued (or, off CUDA, done)."""
        self._mark()

    def seconds(self) -> tuple[float, float]:
        """(forward, after it until now): call once the step's results are on the host."""
        self._mark()
        if not self.cuda:
            begin, stop, now = self._times
            return stop - begin, now - stop
        begin, stop, now = self._marks
        now.synchronize()  # done already: the results were read after it
        return begin.elapsed_time(stop) / 1e3, stop.elapsed_time(now) / 1e3
