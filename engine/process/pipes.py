"""A child process on the other end of a pipe: spawned (not forked: a CUDA context does not
survive a fork), its next message awaited while watching it exit, and stopped by closing the
pipe, then joining, then killing. The ranks of a parallel model (`engine.parallel.ranks`) and
the engine process (`engine.process.client`) are such children."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any


class ChildGone(Exception):
    """The child sent nothing: it exited (`exitcode`) or is still silent at the deadline
    (`exitcode` None)."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__("still silent" if exitcode is None else f"exit code {exitcode}")
        self.exitcode = exitcode


def spawn(
    target: Callable[..., None], args: tuple[Any, ...], name: str
) -> tuple[Connection, BaseProcess]:
    """Start `target(*args, pipe)` in a spawned daemon process (it never outlives this one);
    returns this end of the pipe and the process."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(target=target, args=(*args, theirs), name=name)
    proc.daemon = True
    proc.start()
    theirs.close()
    return ours, proc


def receive(pipe: Connection, proc: BaseProcess, deadline: float) -> Any:
    """The next message from `proc` over `pipe`; ChildGone when it exits first or sends
    nothing by `deadline` (time.monotonic())."""
    while not pipe.poll():
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChildGone(None)
        wait([pipe, proc.sentinel], min(left, 1.0))
        if proc.exitcode is not None and not pipe.poll():
            raise ChildGone(proc.exitcode)
    try:
        return pipe.recv()
    except (EOFError, OSError):
        proc.join(1.0)
        raise ChildGone(proc.exitcode) from None


def stop_child(proc: BaseProcess, deadline: float) -> None:
    """Join `proc` (its pipe already closed), killing it if it has not exited by `deadline`."""
    proc.join(max(0.0, deadline - time.monotonic()))
    if proc.exitcode is None:
        proc.kill()
        proc.join()


def hang_up(pipe: Connection) -> None:
    """End `pipe` both ways (the other end reads EOF, and so does a thread of ours blocked
    reading it), then close it; idempotent. Closing alone would pull the handle from under
    such a thread."""
    with (
        contextlib.suppress(OSError),
        socket.fromfd(pipe.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as ours,
    ):
        ours.shutdown(socket.SHUT_RDWR)
    pipe.close()


class Link:
    """One end of a pipe that several threads send on (a Connection's send is not
    thread-safe: two messages could interleave)."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self.pipe.send(message)
