"""The async engine: one step loop on its own thread, asyncio on the outside.

    loop thread:  drain commands (add / abort) → engine.step() → publish outputs

Callers (the HTTP server) see it through `engine.types.EngineClient`: `generate()` (an async
iterator of `StepOutput`s for one request), `abort()`, `limits` and `stats`. Requests arrive
validated (`engine.validation`). Each request has one output queue; the loop thread hands
outputs to the event loop with `call_soon_threadsafe`, so publishing never blocks the step loop
and the event loop never runs model code (`--overlap`: from a thread of its own while the
next step executes, `engine.device.overlap`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from engine.device.cuda import fatal_device_error, select_device
from engine.device.overlap import StepPipeline
from engine.device.warmup import wants_warmup, warm_up
from engine.engine import Engine
from engine.inputs.images import PreparedImage
from engine.params import ResolvedParams
from engine.process.messages import AddRequest, EngineFailure, Publish
from engine.types import EngineStats, QueueFull, StepListener, StepOutput, StepResult

logger = logging.getLogger(__name__)

# A burst gathered at an idle engine (`AsyncEngine.gather`): after the first command wakes the
# loop, it keeps taking commands while each follows the last within GATHER_GAP_S, up to
# GATHER_MAX_S in all, so requests sent together start in one step.
GATHER_GAP_S = 0.01
GATHER_MAX_S = 0.05


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _ResetPrefixCache:
    done: concurrent.futures.Future[int]


@dataclass(slots=True)
class _LoopCounters:
    """What the loop thread last saw (written by the loop thread only)."""

    num_steps: int = 0
    last_step_time: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_slots_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_usage: float = 0.0


class AsyncEngine:
    """Implements `engine.types.EngineClient` over one `Engine`."""

    def __init__(
        self,
        engine: Engine,
        stall_seconds: float = 60.0,
        gather: tuple[float, float] = (GATHER_GAP_S, GATHER_MAX_S),
        warmup: bool | None = None,
    ) -> None:
        """`gather`: (gap, most) seconds an idle engine waits for more of a burst of requests
        before its first step; (0, 0) steps at once. `warmup`: the loop thread first warms the
        engine up (`engine.device.warmup`; None: `wants_warmup`); requests sent meanwhile wait."""
        self.engine = engine
        self.stall_seconds = stall_seconds
        self.gather = gather
        self.limits = engine.limits
        self._counters = _LoopCounters(last_step_time=time.monotonic())
        self._commands: queue.SimpleQueue[AddRequest | _Abort | _ResetPrefixCache | None] = (
            queue.SimpleQueue()
        )
        self._queues: dict[str, asyncio.Queue[StepOutput | EngineFailure]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Run on the loop thread after every step that ran rows (metrics).
        self.on_step: list[StepListener] = []
        self.on_shutdown: list[Callable[[], None]] = []  # after the loop (a parallel model's ranks)
        self._inflight = 0  # touched on the event loop only
        self._died = False  # the loop thread ended on a fault (set once, by that thread)
        self._failure = ""  # why it ended: a fatal CUDA error (set once, by that thread)
        self._warming = wants_warmup(engine) if warmup is None else warmup  # cleared by the loop
        between = lambda: self._drain_commands(block=False)  # noqa: E731
        self._steps = StepPipeline(engine, self._hand_over, engine.config.overlap, between)
        self.publish: Publish = self._publish_all  # the engine process sends them (engine.process)

    # -- lifecycle --

    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Start the step loop; `loop` holds generate()'s queues (None: the outputs go only to
        a replaced `publish`, as in the engine process, `engine.process.core`)."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="canvas-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        for stop in self.on_shutdown:
            stop()

    def fail(self, reason: str) -> None:
        """Fail for good, from any thread, as on a fatal CUDA error (a parallel rank exited)."""
        self._failure = self._failure or reason
        self._commands.put(None)  # wakes an idle loop

    @property
    def stats(self) -> EngineStats:
        """A snapshot; `healthy`: alive, and stepping whenever there is work (no stall longer
        than stall_seconds); `failure`: why the engine stopped for good, if it did."""
        c = self._counters
        alive = self._thread is not None and self._thread.is_alive()
        idle = c.num_running == 0 and c.num_waiting == 0 and self._inflight == 0
        warming = self._warming and alive  # compiling is progress, not a stall
        stepping = idle or warming or time.monotonic() - c.last_step_time < self.stall_seconds
        return EngineStats(
            alive=alive,
            healthy=alive and stepping and not self._failure,
            num_running=c.num_running,
            num_waiting=c.num_waiting,
            num_inflight=self._inflight,
            kv_usage=c.kv_usage,
            num_slots_used=c.num_slots_used,
            num_steps=c.num_steps,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            prefix_cache_usage=c.prefix_cache_usage,
            failure=self._failure,
            warming_up=warming,
        )

    @property
    def num_inflight(self) -> int:
        return self._inflight

    # -- requests --

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        want_drafts: bool = False,
        images: tuple[PreparedImage, ...] = (),
    ) -> AsyncGenerator[StepOutput, None]:
        """Run one request (validated by `engine.validation`; `images`: its images, whose image
        tokens `prompt_ids` holds); yields its outputs until the one
        with a finish reason, the first one empty once the engine has queued it. Raises
        QueueFull when too many are in flight, and what the engine refused (ParamError) or
        failed with (RuntimeError, also once the step loop has died). Cancelling the iteration
        (client gone) aborts the request."""
        if self._inflight >= self.limits.max_inflight:
            raise QueueFull(f"{self._inflight} requests in flight")
        if request_id in self._queues:  # would take over the running request's outputs
            raise ValueError(f"request id {request_id!r} is already in flight")
        # A schema compiles here, off the step loop (cached: usually the route compiled it).
        constraint = (
            await asyncio.to_thread(self.engine.build_constraint, params)
            if params.json_schema is not None
            else None
        )
        if self._died:  # nothing would ever answer it
            raise self._died_error()
        out_queue: asyncio.Queue[StepOutput | EngineFailure] = asyncio.Queue()
        self._queues[request_id] = out_queue
        self._inflight += 1
        self.submit(AddRequest(request_id, prompt_ids, params, want_drafts, constraint, images))
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, EngineFailure):
                    finished = True
                    raise item.error
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._inflight -= 1
            if not finished:
                self.abort(request_id)

    async def prepare(self, params: ResolvedParams) -> None:
        """Compile a request's grammar in a worker thread (cached; ParamError if invalid)."""
        if params.json_schema is not None:
            await asyncio.to_thread(self.engine.build_constraint, params)

    def fail_all_inflight(self, error: Exception) -> int:
        """Fail every request in flight with `error` and abort it; returns how many (call on
        the event loop, which owns the output queues: each generate() raises at once)."""
        in_flight = list(self._queues.items())
        for request_id, out_queue in in_flight:
            out_queue.put_nowait(EngineFailure(error))
            self.abort(request_id)
        return len(in_flight)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def submit(self, request: AddRequest) -> None:
        """Queue a validated request; its outputs go to `publish` (generate's queues)."""
        self._commands.put(request)

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page, on the loop thread between two steps (running
        requests keep theirs); returns how many pages were forgotten."""
        if self._died or self._thread is None or not self._thread.is_alive():
            raise RuntimeError("step loop is not running")
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._commands.put(_ResetPrefixCache(done))
        return await asyncio.wrap_future(done)

    # -- the loop thread --

    def _run(self) -> None:
        try:
            select_device(self.engine.device)  # this thread launches every kernel
            if self._warming:
                try:
                    warm_up(self.engine, self._stop.is_set)
                finally:  # the stall clock starts now: requests waited on the warm-up
                    self._counters.last_step_time = time.monotonic()
                    self._warming = False
            self._step_loop()
        finally:
            self._steps.close()
            loop = self._loop
            if not self._stop.is_set():  # a fault escaped the loop: fail what is in flight
                self._died = True
                if loop is not None and not loop.is_closed():
                    loop.call_soon_threadsafe(self.fail_all_inflight, self._died_error())

    def _step_loop(self) -> None:
        engine, steps = self.engine, self._steps
        while not self._stop.is_set():
            if not steps.ahead:  # else begun beside the last step, its commands taken then
                if not engine.has_work():  # no next step to hand the last one over beside
                    steps.flush()
                self._drain_commands(block=not engine.has_work())
            if self._stop.is_set() or self._failure:
                break
            try:
                steps.step()
            except Exception as exc:  # a model fault fails the running requests, not the server
                if fatal_device_error(exc):  # ... unless the GPU cannot run anything any more
                    self._fail_device(exc)
                    return
                logger.exception("engine step failed; failing the running requests")
                self._fail_all(RuntimeError("internal engine error"))
            self._update_stats()

    def _hand_over(self, result: StepResult) -> None:
        """A step's counters, listeners and outputs (after it, or beside the next forward)."""
        if result.stats.num_rows == 0:
            return  # nothing ran (idle wake-up): no step to count or observe
        self._counters.num_steps += 1
        self._counters.last_step_time = time.monotonic()
        for listener in self.on_step:
            try:
                listener(result.stats, result.outputs)
            except Exception:  # an observer's fault (metrics) never stops the step loop
                logger.exception("a step listener failed")
        # A request that failed alone ends with an engine error; the others go on. One
        # hand-off per step: one wake-up of the event loop, not one per request.
        self.publish(
            [
                (out.request_id, EngineFailure(RuntimeError(out.error)) if out.error else out)
                for out in result.outputs
            ]
        )

    def _drain_commands(self, block: bool) -> None:
        """Take the commands waiting (block: wait for one first, the engine being idle). A
        command that wakes an idle engine starts a gather: requests a client sent together
        reach the loop a few milliseconds apart (each is parsed, templated and tokenized on the
        event loop first), and stepping at the first one's arrival split a burst of 16 over
        two prefill steps and made the late ones finish a step after the others (one step more
        than an offline batch). A lone request waits one gap."""
        gap, most = self.gather
        deadline = None
        while True:
            try:
                if block:
                    cmd = self._commands.get(timeout=0.5)
                    deadline = time.monotonic() + most if gap > 0 else None
                elif deadline is not None and (left := deadline - time.monotonic()) > 0:
                    cmd = self._commands.get(timeout=min(gap, left))
                else:
                    cmd = self._commands.get_nowait()
            except queue.Empty:
                self._update_stats()
                return
            block = False
            if cmd is None:
                return
            if isinstance(cmd, _Abort):
                if self.engine.abort(cmd.request_id):
                    logger.info("request %s aborted", cmd.request_id)
                continue
            if isinstance(cmd, _ResetPrefixCache):
                try:
                    cmd.done.set_result(self.engine.reset_prefix_cache())
                except Exception as exc:  # reported to the caller, never fatal to the loop
                    cmd.done.set_exception(exc)
                continue
            try:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt_ids,
                    cmd.params,
                    cmd.want_drafts,
                    cmd.constraint,
                    images=cmd.images,
                )
            except (ValueError, QueueFull) as exc:  # ParamError is a ValueError
                self._publish(cmd.request_id, EngineFailure(exc))
            else:  # accepted: the first output, empty (the server starts a response only now)
                self._publish(cmd.request_id, StepOutput(cmd.request_id, []))

    def _update_stats(self) -> None:
        sched, c = self.engine.scheduler, self._counters
        c.num_running = sched.num_running
        c.num_waiting = sched.num_waiting
        c.kv_usage = self.engine.pages.usage()
        c.num_slots_used = sched.slots.num_pages - sched.slots.num_free
        c.prefix_cache_queries = sched.num_queried_tokens
        c.prefix_cache_hits = sched.num_cached_tokens
        c.prefix_cache_usage = self.engine.pages.cache_usage()

    def _fail_device(self, exc: Exception) -> None:
        """A CUDA error the context does not survive: fail every request with it and mark the
        engine failed (`stats.failure`; /health 503), so that the server exits and is
        restarted (`server.serve.serve`) instead of failing every request that follows."""
        text = " ".join(str(exc).split())[:300]
        what = getattr(exc, "failure", "CUDA error, the GPU context is lost")
        self._failure = f"{what}: {type(exc).__name__}: {text}"
        logger.critical("the engine stops: %s", self._failure, exc_info=exc)
        self._fail_all(RuntimeError(f"internal engine error ({self._failure})"))

    def _died_error(self) -> RuntimeError:
        return RuntimeError(
            f"step loop died ({self._failure})" if self._failure else "step loop died"
        )

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._publish(request_id, EngineFailure(error))

    def _publish(self, request_id: str, item: StepOutput | EngineFailure) -> None:
        self.publish([(request_id, item)])

    def _publish_all(self, items: list[tuple[str, StepOutput | EngineFailure]]) -> None:
        """Hand `items` to their requests' queues on the event loop, in order, in one call."""
        loop = self._loop
        if not items or loop is None or loop.is_closed():
            return

        def put() -> None:
            for request_id, item in items:
                out_queue = self._queues.get(request_id)
                if out_queue is not None:  # the client may be gone already
                    out_queue.put_nowait(item)

        loop.call_soon_threadsafe(put)
