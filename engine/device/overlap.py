"""Overlapped steps, and step timing that lets the host run ahead of the device.

Overlapped steps: step t's hand-over (its listeners, metrics, and publishing its outputs to the
event loop) runs on a hand-over thread while the step loop executes step t+1 (its inputs,
forward and sampler):

    step loop:   begin t │ execute t ────────────── │ finish t │ begin t+1 │ execute t+1 ───── ...
    hand-over:           │ hand over t-1 │                     │ hand over t │

`Engine.begin` and `Engine.finish` write the scheduler's state and the hand-over only reads a
finished step's values, so they never race; commands (new requests, aborts) are still taken
between `finish` and the next `begin`, on the step loop. PyTorch's operators and the native
kernels release the interpreter lock, so the hand-over runs beside the next step's inputs and
forward instead of before them. The forward stays on the step loop's thread (its device,
streams, captured graphs and thread count are that thread's), and the steps are the serial
loop's in the same order, so the tokens are too (`tests/e2e/test_overlap.py`). Exact
numerics never overlap: their loop stays the serial one that is checked against the reference.

It is off by default (`canvas serve --overlap`): the hand-over is a few calls, cheaper than
waking a thread for it, and what else a step spends besides its forward and sampler (the
sampler's canvas inputs and state, the forward's inputs, the scheduler) lies between one
forward's results and the next forward, which needs them (docs/performance.md, "Overlapped
steps"). The clock below is what the GPU needs from this module either way: no synchronize.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.types import StepResult

if TYPE_CHECKING:
    from engine.engine import Engine

HandOver = Callable[[StepResult], None]


class StepPipeline:
    """Steps an engine on the calling thread; every step's result goes to `hand_over` once, in
    step order: on the calling thread right after the step (serial), or on the hand-over
    thread while the next step executes (overlapped; `flush` when no step follows)."""

    def __init__(self, engine: Engine, hand_over: HandOver, overlap: bool) -> None:
        self.engine, self.hand_over = engine, hand_over
        self.overlap = overlap and not engine.model.kernels.exact
        self._pool = ThreadPoolExecutor(1, "canvas-hand-over") if self.overlap else None
        self._held: StepResult | None = None  # the last step's result, not passed on yet
        self._handing: Future[None] | None = None  # the last hand-over passed on

    def step(self) -> None:
        """One engine step. What it raises (`Engine.step`) comes after every result before it
        was handed over; the step that raised hands nothing over."""
        engine = self.engine
        if self._pool is None:
            self.hand_over(engine.step())
            return
        try:
            began = engine.begin()
            self._pass_on()  # handed over while this step executes
            self._held = engine.finish(began, engine.execute(began))
        except BaseException:
            self.flush()
            raise

    def flush(self) -> None:
        """Hand the held result over and wait until every result has been."""
        if self._pool is None:
            return
        self._pass_on()
        if self._handing is not None:
            self._handing.result()

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _pass_on(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            assert self._pool is not None
            self._handing = self._pool.submit(self.hand_over, held)


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
        began, queued, done = self._marks
        done.synchronize()  # done already: the results were read after it
        return began.elapsed_time(queued) / 1e3, queued.elapsed_time(done) / 1e3
