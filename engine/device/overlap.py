"""Overlapped steps, and step timing that lets the host run ahead of the device.

Overlapped steps (`canvas serve --overlap`) keep the step loop's thread on the forward and the
sampler and give the rest of a step to a hand-over thread:

- A step whose rows all go on denoising the same canvases (none converged, failed or ended, no
  request waiting that the plan could admit, every running request in it) runs the next step
  ahead: its forward starts at once from the canvas state the sampler just produced
  (`BatchedSampling.canvas_ahead`: no gather of it back from the slots) over the same rows'
  forward batch (`ModelRunner`: reused as it is), while the hand-over thread stores that
  state, applies the step's effects (`Engine.finish`), hands its outputs over, plans the next
  step (`Engine.begin`) and takes the commands that arrived (`between`):

      step loop:  sample t │ forward t+1 ──────────────────────────── │ sample t+1 │ forward t+2
      hand-over:           │ write t, finish t, hand over t, begin t+1, │            │ write t+1, …
                           │ commands                                  │

  The next step keeps that forward when its plan has exactly the rows run ahead; otherwise
  the forward is dropped and the plan runs as planned (`num_dropped`). Commands are taken
  after the plan, so they count from the step after it: an abort taken then ends a request
  whose row is in the step (the scheduler's update drops its effect; its sampler slot's write
  is harmless: the next request bound to that slot starts its canvas afresh).
- Any other step hands its outputs over on that thread while the next step executes.

One writer at a time: the step loop waits for the hand-over thread before it samples again,
the forward it runs meanwhile reads only its own inputs and the model, and the hand-over
thread writes the scheduler's state and the sampler's slots, which nothing else touches
then. The steps are the serial loop's, in the same order and with the same inputs, so the
tokens are too (`tests/e2e/test_overlap.py`). Exact numerics never overlap, and steps run
ahead only with the fast sampler's eager steps (its graphs' outputs are overwritten by the
next replay; the sharded sampler's forward reads the running requests).

Off by default (docs/performance.md, "Overlapped steps", has the measurements). The clock
below is what the GPU needs from this module either way: no synchronize.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from engine.batched_sampler import ROW_FIELDS, RowStates
from engine.cpu_threads import one_thread
from engine.device.cuda import fatal_device_error, select_device
from engine.sampling import BatchedSampling, CanvasBatch
from engine.types import RowEffect, RowKind, ScheduledRow, StepPlan, StepResult

if TYPE_CHECKING:
    from engine.engine import Engine, Launched, StepBegun, Write

logger = logging.getLogger(__name__)

HandOver = Callable[[StepResult], None]


class StepPipeline:
    """Steps an engine on the calling thread; every step's result goes to `hand_over` once, in
    step order: on the calling thread right after the step (serial), or on the hand-over
    thread while the next step executes (overlapped; `flush` when no step follows).

    Overlapped, a step whose canvases all go on denoising (`_next_rows`) runs the next one
    ahead: its forward starts from the canvas state this step's sampler produced (with the
    same rows' inputs) while the hand-over thread finishes this step (the scheduler's update),
    hands it over, begins the next (plans it) and takes the commands that arrived
    (`between`). The next step keeps that forward when its plan has the rows it ran;
    otherwise the forward is dropped and the plan runs as planned. `ahead`: the next step is
    begun already (its commands taken), so the caller takes none before it."""

    def __init__(
        self,
        engine: Engine,
        hand_over: HandOver,
        overlap: bool,
        between: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine, self.hand_over, self.between = engine, hand_over, between
        self.overlap = overlap and not engine.model.kernels.exact
        self._pool = None
        if self.overlap:
            self._pool = ThreadPoolExecutor(1, "canvas-hand-over", _helper, (engine.device,))
        self._held: StepResult | None = None  # the last step's result, not passed on yet
        self._handing: Future[Any] | None = None  # the last hand-over passed on
        # The fast sampler (the sharded one's forward reads the scheduler's running requests:
        # not while the next step is planned).
        self.runs_ahead = self.overlap and type(engine.sampling) is BatchedSampling
        self._ahead: tuple[StepBegun, Launched | None] | None = None
        self.num_ahead = self.num_dropped = 0  # forwards run ahead: kept, and dropped

    @property
    def ahead(self) -> bool:
        return self._ahead is not None

    def step(self) -> None:
        """One engine step. What it raises (`Engine.step`) comes after every result before it
        was handed over; the step that raised hands nothing over."""
        engine = self.engine
        if self._pool is None:
            self.hand_over(engine.step())
            return
        try:
            began, launched = self._ahead or (engine.begin(), None)
            self._ahead = None
            self._pass_on()  # handed over while this step executes
            writes: list[Write] = []  # the sampler's state writes, run before it samples again
            if launched is not None:
                launched[3].clock.resume()  # its sampler's time starts now
            effects = engine.execute(began, launched, writes)
            rows = self._next_rows(began, effects)
            if rows is None or not self._run_ahead(began, effects, writes, rows):
                for write in writes:
                    write()
                self._held = engine.finish(began, effects)
        except BaseException:
            self._ahead = None
            self.flush()
            raise

    def _next_rows(self, began: StepBegun, effects: list[RowEffect]) -> list[ScheduledRow] | None:
        """The rows of the step after `began` when they are surely its DENOISE rows again:
        every running request has one DENOISE row that goes on denoising its canvas (none
        finished, failed or ended; no token pinned), any other row is a prompt's last chunk or
        a commit that its request's canvas step rode along with (nothing sampled, nothing
        failed), and no request waits that the plan could admit. None otherwise."""
        rows, sched = began.plan.rows, self.engine.scheduler
        if not self.runs_ahead or not rows:
            return None
        if sched.waiting and sched.num_running < sched.config.max_num_seqs:
            return None
        denoise = []
        for row, effect in zip(rows, effects, strict=True):
            if effect.error is not None or effect.finish_reason is not None or effect.tokens:
                return None
            if row.kind == RowKind.DENOISE:
                if effect.progress.canvas_steps is not None or row.req.pinned_token >= 0:
                    return None
                denoise.append(row)
            elif row.kind not in (RowKind.PREFILL, RowKind.COMMIT):
                return None  # an AR or verify row: what follows is its mode's choice
        requests = {row.seq_id for row in denoise}
        if len(requests) != len(denoise) or len(denoise) != sched.num_running:
            return None
        if any(seq_id not in sched.requests for seq_id in requests):
            return None
        return [replace(row, admitted=False, starts_canvas=False) for row in denoise]

    def _run_ahead(
        self,
        began: StepBegun,
        effects: list[RowEffect],
        writes: list[Write],
        rows: list[ScheduledRow],
    ) -> bool:
        """The next step's forward over `rows` while the hand-over thread stores the sampler's
        new state (`writes`, emptied if run here), finishes `began`, hands it over and begins
        the next step. The forward's canvas inputs are that state as it was sampled, or, where
        the sampler cannot give it as a value (its graphs), gathered from the slots once it is
        stored; either way taken before the hand-over thread starts (it may end requests).
        False, with nothing begun, if those inputs could not be made."""
        engine = self.engine
        canvas = canvas_ahead(engine.sampling, len(rows))  # type: ignore[arg-type]
        if canvas is None:
            for write in writes:
                write()
            writes.clear()
        try:
            planned = engine.inputs(rows, canvas)
        except Exception as exc:
            if fatal_device_error(exc):
                raise
            logger.warning("the inputs of a step to run ahead failed: %r", exc)
            return False
        threads = engine.threads.choose(began.plan.num_tokens) if engine.threads else 0
        assert self._pool is not None
        start = time.perf_counter()  # step `began` ends, the next one begins
        self._handing = job = self._pool.submit(
            self._between, began, effects, writes, threads, start
        )
        launched: Launched | None = None
        try:
            launched = engine.forward(planned)
        except Exception as exc:
            if fatal_device_error(exc):
                raise
            logger.warning("a step run ahead failed; its plan runs as planned: %r", exc)
        finally:
            began_next = job.result()  # the engine is this thread's again
        if launched is not None and _same_rows(rows, began_next.plan):
            self._ahead = replace(began_next, start=start), launched
            self.num_ahead += 1
            began_next.stats.ran_ahead = True
        else:
            self._ahead = began_next, None
            self.num_dropped += launched is not None
            began_next.stats.dropped_forwards += launched is not None
        return True

    def _between(
        self,
        began: StepBegun,
        effects: list[RowEffect],
        writes: list[Write],
        threads: int,
        end: float,
    ) -> StepBegun:
        for write in writes:
            write()
        self.hand_over(self.engine.finish(began, effects, end))
        began_next = self.engine.begin(threads)
        self.between()  # commands after the plan: they count from the step after it
        return began_next

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


def _helper(device: torch.device) -> None:
    """The hand-over thread's set-up: its writes of the sampler's state launch kernels on the
    engine's device; on a CPU they run on one thread (a parallel region here would build an
    OpenMP team beside the step loop's, `engine.cpu_threads.confine_to_steps`)."""
    select_device(device)
    if device.type == "cpu":
        one_thread()


def canvas_ahead(sampling: BatchedSampling, num_rows: int) -> CanvasBatch | None:
    """The next step's canvas inputs of the `num_rows` rows of the last `sample_canvases` (in
    its order; the caller stores every one's new state first, none starts a canvas or pins a
    token): `canvas_inputs`' values, without gathering them back from the slots. None where
    the last call sampled other rows (a step's rows re-run one at a time) or the sampler's
    steps replay graphs (the next replay overwrites their outputs)."""
    rows, state = sampling.sampled, sampling.sampler.state
    if rows is None or sampling.steps is not sampling.sampler or len(rows.slots) != num_rows:
        return None
    # Stored in the slots' dtypes (self-conditioning: the model's), gathered as stored.
    stored = (getattr(rows, n).to(getattr(state, n).dtype) for n in ROW_FIELDS)
    rows = RowStates(rows.slots, *stored)
    return CanvasBatch(rows.canvas.reshape(-1), rows.soft.flatten(0, 1), rows)


def _same_rows(ahead: list[ScheduledRow], plan: StepPlan) -> bool:
    """`plan` runs exactly the rows run ahead (the same requests' rows, in order)."""
    if plan.copies or len(plan.rows) != len(ahead):
        return False
    key = lambda r: (r.kind, r.start, r.num_tokens, r.admitted, r.starts_canvas)  # noqa: E731
    return all(a.req is b.req and key(a) == key(b) for a, b in zip(ahead, plan.rows, strict=True))


class ForwardClock:
    """A step's forward time and its sampler's after it. On CUDA between events, read once the
    sampler has read its results to the host (so they are done: no `synchronize`, and the host
    may run ahead of the device); elsewhere the host's clock. Started when made."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[torch.cuda.Event] = []
        self._times: list[float] = []
        self._resumed = 0.0
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

    def resume(self) -> None:
        """The sampler's time starts now: the host waited for something else since the forward
        ended (a step run ahead, `StepPipeline`). On CUDA the events' device times stand."""
        self._resumed = time.perf_counter()

    def seconds(self) -> tuple[float, float]:
        """(forward, after it until now): call once the step's results are on the host."""
        self._mark()
        if not self.cuda:
            begin, stop, now = self._times
            return stop - begin, now - max(stop, self._resumed)
        began, queued, done = self._marks
        done.synchronize()  # done already: the results were read after it
        return began.elapsed_time(queued) / 1e3, queued.elapsed_time(done) / 1e3
