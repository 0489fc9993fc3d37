"""The serving process's side of the engine process: `RemoteEngine`, an
`engine.types.EngineClient` whose engine runs in a spawned process (`engine.process.core`).

Requests go over the pipe as they come; outputs come back one message per step, read on a
thread that runs the `on_step` listeners and hands each step's outputs to their requests'
queues on the event loop in one call, as `AsyncEngine`'s step loop does. What stays here:
tokenizing, templates, images (pickled over the pipe: docs/performance.md has their cost) and
checking a JSON schema (`prepare`). Failure: an engine process that exits (killed, out of
memory) fails every request in flight and the engine for good (`stats.failure`: /health 503
with the reason, the server exits to be restarted); one that stops reporting for
`stall_seconds` is unhealthy. The engine process exits when this process closes the pipe
(`shutdown`) or dies."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from engine.build import has_tokenizer
from engine.inputs.images import PreparedImage
from engine.inputs.tokenizer import Tokenizer
from engine.params import ParamError, ResolvedParams
from engine.process.core import EngineSpec, engine_main
from engine.process.messages import AddRequest, EngineFailure, EngineInfo
from engine.process.pipes import ChildGone, Link, hang_up, receive, spawn, stop_child
from engine.structured import GrammarCompiler, grammar_compiler
from engine.types import EngineStats, QueueFull, StepListener, StepOutput

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 3600.0  # a big checkpoint read from a slow disk, then its KV cache
STOP_TIMEOUT_S = 10.0  # an engine process not gone by then after its pipe closed is killed


class RemoteEngine:
    """Implements `engine.types.EngineClient` over an engine process, spawned and built here:
    the constructor returns once it is loaded (`info`), raising its start-up error (or
    RuntimeError naming how it exited)."""

    def __init__(
        self, spec: EngineSpec, stall_seconds: float = 60.0, timeout_s: float = START_TIMEOUT_S
    ) -> None:
        self.pipe, self.proc = spawn(engine_main, (spec,), "canvas-engine")
        self.link = Link(self.pipe)
        self.stall_seconds = stall_seconds
        self.on_step: list[StepListener] = []
        self._stopping = False
        self._reader: threading.Thread | None = None
        try:
            kind, value = receive(self.pipe, self.proc, time.monotonic() + timeout_s)
        except ChildGone as gone:
            self.shutdown()
            raise RuntimeError(f"the engine process did not start ({gone})") from None
        if kind == "error":
            self.shutdown()
            raise value
        self.info: EngineInfo = value[0]
        self._remote: EngineStats = value[1]  # the engine process's last report
        self.limits = self.info.limits
        model_dir = self.info.model_dir
        self.tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
        self._heard = time.monotonic()
        self._queues: dict[str, asyncio.Queue[StepOutput | EngineFailure]] = {}
        self._resets: dict[int, asyncio.Future[int]] = {}
        self._tokens = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight = 0  # touched on the event loop only
        self._died = False  # the engine's step loop ended (the engine process said so)
        self._failure = ""  # why the engine process exited
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    # -- lifecycle --

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heard = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="canvas-engine-read", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Close the pipe (the engine process stops its loop and exits), join it; idempotent."""
        self._stopping = True
        hang_up(self.pipe)
        stop_child(self.proc, time.monotonic() + timeout)
        if self._reader is not None:
            self._reader.join(timeout)

    @property
    def stats(self) -> EngineStats:
        """The engine process's last report with this side's requests in flight; unhealthy
        once it has exited, failed, or not reported for `stall_seconds`."""
        remote = self._remote
        alive = remote.alive and not self._failure
        heard = time.monotonic() - self._heard < self.stall_seconds
        return dataclasses.replace(
            remote,
            alive=alive,
            healthy=remote.healthy and alive and heard,
            num_inflight=self._inflight,
            failure=self._failure or remote.failure,
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
        """As `AsyncEngine.generate`; RuntimeError once the engine process has failed."""
        if self._inflight >= self.limits.max_inflight:
            raise QueueFull(f"{self._inflight} requests in flight")
        if request_id in self._queues:  # would take over the running request's outputs
            raise ValueError(f"request id {request_id!r} is already in flight")
        await self.prepare(params)
        if self._failure or self._died:
            raise RuntimeError(f"engine failed ({self._failure or 'step loop died'})")
        out_queue: asyncio.Queue[StepOutput | EngineFailure] = asyncio.Queue()
        self._queues[request_id] = out_queue
        self._inflight += 1
        finished = False
        add = ("add", AddRequest(request_id, prompt_ids, params, want_drafts, None, images))
        # Megabytes of pixels are pickled and written off the event loop (milliseconds an
        # image), and not cancelled halfway: an abort must follow its request down the pipe.
        sending = asyncio.ensure_future(asyncio.to_thread(self._send, add)) if images else None
        try:
            if sending is None:
                self._send(add)
            else:
                await asyncio.shield(sending)
            while True:
                item = await out_queue.get()
                if isinstance(item, EngineFailure):
                    finished = True
                    raise item.error
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._inflight -= 1
            if not finished and sending is not None and not sending.done():
                sending.add_done_callback(lambda _: self.abort(request_id))
            elif not finished:
                self.abort(request_id)

    async def prepare(self, params: ResolvedParams) -> None:
        """Check a request's JSON schema here, in a worker thread (cached; ParamError naming
        `response_format`); the engine process builds its own grammar state from it."""
        if params.json_schema is not None:
            await asyncio.to_thread(self._check_schema, params.json_schema)

    def _check_schema(self, schema: str) -> None:
        with self._grammar_lock:
            if self._grammar is None and self.tokenizer is not None:
                eos = self.info.defaults.eos_token_ids
                self._grammar = grammar_compiler(self.tokenizer, self.limits.vocab_size, eos)
        if self._grammar is None:
            raise ParamError(
                "response_format", "structured output needs the checkpoint's (fast) tokenizer"
            )
        self._grammar.constraint(schema)

    def abort(self, request_id: str) -> None:
        if not self._stopping and not self._failure:
            self._send(("abort", request_id))

    def fail_all_inflight(self, error: Exception) -> int:
        """As `AsyncEngine.fail_all_inflight` (call on the event loop)."""
        in_flight = list(self._queues.items())
        for request_id, out_queue in in_flight:
            out_queue.put_nowait(EngineFailure(error))
            self.abort(request_id)
        return len(in_flight)

    async def reset_prefix_cache(self) -> int:
        """As `AsyncEngine.reset_prefix_cache`, in the engine process."""
        if self._failure or self._died or self._loop is None:
            raise RuntimeError("step loop is not running")
        token = next(self._tokens)
        done: asyncio.Future[int] = self._loop.create_future()
        self._resets[token] = done
        self._send(("reset", token))
        try:
            return await done
        finally:
            self._resets.pop(token, None)

    def _send(self, message: Any) -> None:
        with contextlib.suppress(OSError):  # the engine process is gone: the reader fails it
            self.link.send(message)

    # -- the reader thread --

    def _read(self) -> None:
        while True:
            try:
                kind, value = self.pipe.recv()
            except (EOFError, OSError):
                break
            self._heard = time.monotonic()
            if kind == "out":
                step, items = value
                if step is not None:
                    self._observe(*step)
                self._call(self._put, items)
            elif kind == "stats":
                self._remote = value
                if not value.alive and not self._died:  # its step loop ended on a fault
                    self._died = True
                    self._call(self.fail_all_inflight, RuntimeError("step loop died"))
            elif kind == "reset":
                self._call(self._resolve, *value)
        if not self._stopping:
            self.proc.join(STOP_TIMEOUT_S)
            self._failure = f"the engine process exited (code {self.proc.exitcode})"
            logger.critical("%s: the engine stops", self._failure)
            error = RuntimeError(f"internal engine error ({self._failure})")
            self._call(self.fail_all_inflight, error)
            self._call(self._fail_resets, error)

    def _observe(self, stats: Any, outputs: list[StepOutput]) -> None:
        for listener in self.on_step:
            try:
                listener(stats, outputs)
            except Exception:  # an observer's fault (metrics) never stops the reader
                logger.exception("a step listener failed")

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    def _put(self, items: list[tuple[str, StepOutput | EngineFailure]]) -> None:
        for request_id, item in items:
            out_queue = self._queues.get(request_id)
            if out_queue is not None:  # the client may be gone already
                out_queue.put_nowait(item)

    def _resolve(self, token: int, result: int | Exception) -> None:
        done = self._resets.get(token)
        if done is None or done.done():
            return
        if isinstance(result, Exception):
            done.set_exception(result)
        else:
            done.set_result(result)

    def _fail_resets(self, error: Exception) -> None:
        for token in list(self._resets):
            self._resolve(token, error)
