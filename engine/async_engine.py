"""The async engine: one step loop on its own thread, asyncio on the outside.

    loop thread:  drain commands (add / abort) → engine.step() → publish outputs

Callers (the HTTP server) use `generate()` — an async iterator of `StepOutput`s for one request —
and `abort()`. Each request has one output queue; the loop thread hands outputs to the event loop
with `call_soon_threadsafe`, so publishing never blocks the step loop and the event loop never
runs model code.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.engine import Engine, StepOutput
from engine.params import ResolvedParams
from engine.scheduler import QueueFull

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    want_drafts: bool


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Put on a request's queue when the engine could not run it; `error` is re-raised."""

    error: Exception


@dataclass(slots=True)
class LoopStats:
    """Read by /metrics and /health (written by the loop thread only)."""

    num_steps: int = 0
    last_step_time: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0


class AsyncEngine:
    def __init__(self, engine: Engine, stall_seconds: float = 60.0) -> None:
        self.engine = engine
        self.stall_seconds = stall_seconds
        self.stats = LoopStats(last_step_time=time.monotonic())
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[StepOutput | EngineFailure]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Run on the loop thread after every step that ran rows (metrics).
        self.on_step: list[Callable[[Engine, list[StepOutput]], None]] = []
        sched = engine.scheduler.config
        self.max_inflight = sched.max_num_seqs + sched.max_queue
        self._inflight = 0  # touched on the event loop only

    # -- lifecycle --

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="canvas-step-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def is_healthy(self) -> bool:
        """Alive, and stepping whenever there is work (no stall longer than stall_seconds)."""
        if not self.is_alive():
            return False
        idle = self.stats.num_running == 0 and self.stats.num_waiting == 0 and self._inflight == 0
        return idle or time.monotonic() - self.stats.last_step_time < self.stall_seconds

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
    ) -> AsyncIterator[StepOutput]:
        """Run one request; yields its outputs until the one with a finish reason. Raises
        ParamError for a prompt that cannot run and QueueFull when too many are waiting.
        Cancelling the iteration (client gone) aborts the request."""
        self.engine.check_prompt(prompt_ids)
        self.engine.check_context(len(prompt_ids), params)
        if self._inflight >= self.max_inflight:
            raise QueueFull(f"{self._inflight} requests in flight")
        out_queue: asyncio.Queue[StepOutput | EngineFailure] = asyncio.Queue()
        self._queues[request_id] = out_queue
        self._inflight += 1
        self._commands.put(_Add(request_id, prompt_ids, params, want_drafts))
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

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- the loop thread --

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._drain_commands(block=not engine.has_work())
            if self._stop.is_set():
                break
            try:
                outputs = engine.step()
            except Exception:  # a model fault fails the running requests, not the server
                logger.exception("engine step failed; failing the running requests")
                self._fail_all(RuntimeError("internal engine error"))
                continue
            self._update_stats()
            if engine.last_step.num_rows == 0:
                continue  # nothing ran (idle wake-up): no step to count or observe
            self.stats.num_steps += 1
            self.stats.last_step_time = time.monotonic()
            for hook in self.on_step:
                hook(engine, outputs)
            for out in outputs:
                self._publish(out.request_id, out)

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
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
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.want_drafts)
            except (ValueError, QueueFull) as exc:  # ParamError is a ValueError
                self._publish(cmd.request_id, EngineFailure(exc))

    def _update_stats(self) -> None:
        sched = self.engine.scheduler
        self.stats.num_running = sched.num_running
        self.stats.num_waiting = sched.num_waiting
        self.stats.kv_usage = self.engine.pages.usage()

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._publish(request_id, EngineFailure(error))

    def _publish(self, request_id: str, item: StepOutput | EngineFailure) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def put() -> None:
            out_queue = self._queues.get(request_id)
            if out_queue is not None:  # the client may be gone already
                out_queue.put_nowait(item)

        loop.call_soon_threadsafe(put)
