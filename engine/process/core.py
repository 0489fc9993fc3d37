"""The engine process (`canvas serve --engine-process`): it builds the engine from the serving
process's configuration (`EngineSpec`), says what it loaded (`EngineInfo`, or the start-up
error), then runs `AsyncEngine`'s step loop until its pipe closes (the serving process stopped
it or died). Over the pipe, from the serving process: ("add", AddRequest), ("abort", id),
("reset", token). To it: ("ready", (EngineInfo, EngineStats)) or ("error", exception) once;
then ("out", (step, outputs)) per step, `step` being the `on_step` listeners' (StepStats,
outputs) and `outputs` what the requests' queues get (also for a request accepted or refused
between steps, with no step); ("stats", EngineStats) every HEARTBEAT_S; ("reset", (token,
pages or exception)).

A request's JSON schema is compiled here as well, on this process's main thread (which reads
the pipe), off the step loop: the grammar state does not cross a pipe."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pickle
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine.async_engine import AsyncEngine
from engine.build import BuildConfig, Checkpoint, build
from engine.cpu_threads import describe_threads
from engine.engine import Engine
from engine.process.messages import AddRequest, EngineFailure, EngineInfo
from engine.process.pipes import Link
from engine.types import StepOutput, StepStats

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.1  # how stale the serving process's view of the engine's stats may get


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What the engine process builds (`config`), whether it warms up first (None:
    `engine.device.warmup.wants_warmup`), and `setup`, run there before anything else (the
    serving process's logging and thread policy; pickled by reference)."""

    config: BuildConfig
    warmup: bool | None = None
    setup: Callable[[], None] | None = None


def engine_info(checkpoint: Checkpoint, engine: Engine) -> EngineInfo:
    """What a serving process needs of `engine` (built from `checkpoint`) when it does not
    hold it, and what its banner says."""
    model = engine.model
    assert checkpoint.model_dir is not None, "opened from a directory"
    return EngineInfo(
        model_dir=checkpoint.model_dir,
        name=checkpoint.name or checkpoint.model_dir.name,
        defaults=checkpoint.defaults,
        vision=model.vision is not None,
        limits=engine.limits,
        canvas_length=model.config.canvas_length,
        num_layers=model.cfg.num_layers,
        dtype=str(next(model.parameters()).dtype),
        kernels=model.kernels.describe(),
        adapter=model.adapter is not None,
        threads=describe_threads(engine.config.cpu_threads, model.kernels.exact),
    )


class Outbox:
    """The engine process's `publish`: one message per call, carrying the step whose
    hand-over made the call (its `on_step` listeners' arguments, kept per thread: with
    `--overlap` a step is handed over on a thread of its own while the loop publishes). Sent
    from the publishing thread: a sender thread of its own measured slower on a busy CPU (it
    took the interpreter lock from the step's own work; a step's message pickles in tens of
    microseconds)."""

    def __init__(self, core: AsyncEngine, link: Link) -> None:
        self.link = link
        self.steps: dict[int, tuple[StepStats, list[StepOutput]]] = {}
        core.on_step.append(self.step)
        core.publish = self.send

    def step(self, stats: StepStats, outputs: list[StepOutput]) -> None:
        self.steps[threading.get_ident()] = (stats, outputs)

    def send(self, items: list[tuple[str, StepOutput | EngineFailure]]) -> None:
        step = self.steps.pop(threading.get_ident(), None)
        with contextlib.suppress(OSError):  # the serving process is gone: the pipe's reader ends
            self.link.send(("out", (step, items)))


def engine_main(spec: EngineSpec, pipe: Connection) -> None:
    """The engine process: build, say ready (or why not, then exit 1), step until the pipe
    closes, stop the step loop and return (exit 0)."""
    link = Link(pipe)
    if spec.setup is not None:
        spec.setup()
    try:
        checkpoint, engine = build(spec.config)
        core = AsyncEngine(engine, warmup=spec.warmup)
    except Exception as exc:  # noqa: BLE001 (the serving process raises it)
        link.send(("error", portable(exc)))
        sys.exit(1)
    Outbox(core, link)
    link.send(("ready", (engine_info(checkpoint, engine), core.stats)))
    core.start(None)
    stopped = threading.Event()
    beat = threading.Thread(target=heartbeat, args=(core, link, stopped), name="canvas-beat")
    beat.start()
    try:
        follow_commands(core, engine, pipe, link)
    finally:
        stopped.set()
        core.shutdown()
        beat.join()


def portable(error: Exception) -> Exception:
    """`error` if it pickles, else a RuntimeError with its type and text."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 (anything unpicklable)
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def heartbeat(core: AsyncEngine, link: Link, stopped: threading.Event) -> None:
    """Send the engine's stats every HEARTBEAT_S until `stopped` or the pipe breaks."""
    while not stopped.wait(HEARTBEAT_S):
        try:
            link.send(("stats", core.stats))
        except OSError:
            return


def follow_commands(core: AsyncEngine, engine: Engine, pipe: Connection, link: Link) -> None:
    """Carry out the serving process's commands until the pipe closes."""
    while True:
        try:
            kind, value = pipe.recv()
        except (EOFError, OSError):
            return
        if kind == "add":
            add(core, engine, value)
        elif kind == "abort":
            core.abort(value)
        elif kind == "reset":
            try:
                result: int | Exception = asyncio.run(core.reset_prefix_cache())
            except Exception as exc:  # noqa: BLE001 (the caller's coroutine raises it)
                result = portable(exc)
            link.send(("reset", (value, result)))
        else:
            raise AssertionError(f"unknown command {kind!r}")


def add(core: AsyncEngine, engine: Engine, request: AddRequest) -> None:
    """Queue `request` with its grammar state, built here; a schema the engine refuses fails
    the request (the serving process compiled it already: this is the rare disagreement)."""
    try:
        constraint = engine.build_constraint(request.params)
    except ValueError as exc:
        core.publish([(request.request_id, EngineFailure(exc))])
        return
    core.submit(dataclasses.replace(request, constraint=constraint))
