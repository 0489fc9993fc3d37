"""The processes of a served parallel model: rank 0 (the serving process) spawns one follower
per other rank (`engine.process.pipes.spawn`: not forked, a CUDA context does not survive a fork),
and each follower (`follower_main`) joins the world, loads its shard, builds its KV cache with
rank 0's page counts and follows rank 0's calls (`engine.parallel.step`) until it is stopped or
the world breaks. A pipe from rank 0 to each follower carries the start-up hand-shake (what was
loaded, the cache's size, ready) and then the calls.

Failure: a follower that fails before it is ready says why over its pipe and exits 1; rank 0
raises WorldError naming its rank and reason (a follower that died without a word: its exit
code). Once serving, `watch` calls back when a follower exits (rank 0 then fails the engine for
good), and a follower whose rank 0 is gone sees its pipe close and exits 1: no process is left
behind and none waits for a dead peer. `stop` releases, joins, and at last kills the
followers; it also runs when rank 0's process exits (`atexit`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from engine.model.config import LayerType
from engine.model.kv_cache import PagedKVCache
from engine.parallel.loader import load_sharded
from engine.parallel.step import Leader, follow
from engine.parallel.world import World, WorldError, close_world, init_world
from engine.process.pipes import ChildGone, receive, spawn, stop_child

logger = logging.getLogger(__name__)

# How long rank 0 waits for the followers to load their shards (a big checkpoint read from a
# slow disk) and for the world to form (each follower first imports torch).
LOAD_TIMEOUT_S = 3600.0
WORLD_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0  # a stopped follower that has not exited by then is killed


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank loads: the checkpoint directory, the split (`expert_parallel`), the
    dtype and kernel backend, the world's address and backend, torch's CPU threads, and how
    long the world may take to form (`timeout_s`; also its collectives' timeout)."""

    model_dir: Path
    size: int
    expert_parallel: bool
    dtype: str
    kernels: str
    init_method: str
    backend: str
    threads: int
    timeout_s: float = WORLD_TIMEOUT_S


def follower_main(rank: int, spec: RankSpec, pipe: Connection) -> None:
    """A follower process: join, load, build the cache rank 0 sizes, say ready, follow. Exits
    0 once stopped, 1 when it cannot start (the reason sent to rank 0) or the world breaks."""
    stage = "join the world"
    try:
        torch.set_num_threads(spec.threads)
        world = init_world(rank, spec.size, spec.backend, spec.init_method, spec.timeout_s)
        stage = "load its shard"
        sharded = load_sharded(
            spec.model_dir, world, spec.expert_parallel, spec.dtype, spec.kernels
        )
        pipe.send(("loaded", sharded.bytes_read))
        stage = "build its KV cache"
        pages, page_size, dtype = pipe.recv()
        cache = PagedKVCache(sharded.plan.kv_config(), pages, page_size, dtype, world.device)
        pipe.send(("ready", None))
        stage = "follow rank 0"
        with torch.inference_mode():
            calls = follow(sharded.model, cache, world, pipe)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 (reported to rank 0, then exit 1)
        reason = f"rank {rank} could not {stage}: {type(exc).__name__}: {exc}"
        if stage != "follow rank 0":
            with contextlib.suppress(OSError):
                pipe.send(("error", reason))
        print(f"canvas: {reason}", file=sys.stderr, flush=True)
        close_world()
        os._exit(1)  # no waiting for a world that cannot finish its collectives
    close_world()
    logger.debug("rank %d stopped after %d calls", rank, calls)


class Ranks:
    """Rank 0's handle of its followers (ranks 1..size-1, in order)."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.pipes: list[Connection] = []
        self.procs: list[BaseProcess] = []
        self.world: World | None = None
        self.joiner: threading.Thread | None = None  # rank 0 joining the world
        self.leader: Leader | None = None
        self.stopping = False
        for rank in range(1, spec.size):
            pipe, proc = spawn(follower_main, (rank, spec), f"canvas-rank-{rank}")
            self.pipes.append(pipe)
            self.procs.append(proc)
        atexit.register(self.stop)

    def join_world(self) -> World:
        """Rank 0's place in the world; WorldError naming a follower that exited first (the
        world cannot form without it: rank 0 does not wait out the timeout for it)."""
        spec, joined = self.spec, queue.SimpleQueue[World | WorldError]()

        def join() -> None:
            try:
                joined.put(init_world(0, spec.size, spec.backend, spec.init_method, spec.timeout_s))
            except WorldError as exc:
                joined.put(exc)

        # Left behind when a follower exits first: it ends at the timeout, or with the process.
        self.joiner = threading.Thread(target=join, name="canvas-world-join", daemon=True)
        self.joiner.start()
        while True:
            try:
                got = joined.get(timeout=0.2)
            except queue.Empty:
                if gone := self.exited():
                    raise WorldError(
                        f"the world of {spec.size} ranks cannot form: {gone}"
                    ) from None
                continue
            if isinstance(got, WorldError):
                raise got
            self.world = got
            return got

    def exited(self) -> str:
        """The followers that have exited, with their exit codes ('' when none has)."""
        return ", ".join(
            f"rank {r} exited with code {p.exitcode}"
            for r, p in enumerate(self.procs, start=1)
            if p.exitcode is not None
        )

    def gather(self, what: str, timeout_s: float = LOAD_TIMEOUT_S) -> list[Any]:
        """One `what` message from every follower, in rank order. WorldError naming the rank
        that reported an error, exited or was not done within `timeout_s`."""
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        for rank, (pipe, proc) in enumerate(zip(self.pipes, self.procs, strict=True), start=1):
            try:
                kind, value = receive(pipe, proc, deadline)
            except ChildGone as gone:
                if gone.exitcode is None:
                    raise WorldError(f"rank {rank} did not {what} within {timeout_s:g} s") from None
                raise WorldError(
                    f"rank {rank} exited before it could {what} (exit code {gone.exitcode})"
                ) from None
            if kind == "error":
                raise WorldError(value)
            out.append(value)
        return out

    def serve(self, leader: Leader, cache: PagedKVCache) -> None:
        """Size every follower's KV cache like rank 0's `cache` (the same pages per pool), wait
        until each is ready, then lead: the model's calls and the cache's copies go to them."""
        for pipe in self.pipes:
            pipe.send((page_counts(cache), cache.page_size, cache.keys[0].dtype))
        self.gather("build its KV cache")
        self.leader = leader
        leader.lead(cache)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call `on_exit(reason)` (from a watcher thread) when a follower exits before `stop`."""

        def run() -> None:
            sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
            ready = wait(list(sentinels))
            if self.stopping:
                return
            rank, proc = sentinels[ready[0]]  # type: ignore[index]
            proc.join(0)
            reason = f"rank {rank} of the parallel model exited (code {proc.exitcode})"
            logger.critical("%s: the engine stops", reason)
            on_exit(reason)

        threading.Thread(target=run, name="canvas-rank-watch", daemon=True).start()

    def stop(self) -> None:
        """Release the followers, join them (killing one not gone after STOP_TIMEOUT_S) and
        leave the world; idempotent."""
        if self.stopping:
            return
        self.stopping = True
        if self.leader is not None:
            self.leader.stop()
        for pipe in self.pipes:
            pipe.close()  # a follower not yet serving sees its pipe close and exits
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            stop_child(proc, deadline)
        close_world()


def page_counts(cache: PagedKVCache) -> dict[LayerType, int]:
    """Pages per pool of `cache`."""
    return {t: cache.keys[cache.layer_types.index(t)].shape[0] for t in set(cache.layer_types)}
