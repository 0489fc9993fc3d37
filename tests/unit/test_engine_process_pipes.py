"""The engine process's pipe: a refused request's error crosses it with its field, a child
that exits without a word is named with its exit code, a hung-up pipe wakes a thread blocked
reading it."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
from multiprocessing.connection import Connection

import pytest

from engine.process.pipes import ChildGone, hang_up, receive, spawn, stop_child


def says_then_exits(code: int, pipe: Connection) -> None:
    if code == 0:
        pipe.send(("ready", 42))
    raise SystemExit(code)


def test_a_refused_requests_error_crosses_the_pipe_with_its_field() -> None:
    from engine.params import ParamError
    from engine.process.messages import EngineFailure
    from engine.validation import ContextLengthError

    for error in (ParamError("response_format", "bad"), ContextLengthError(10, 5, 8, 8)):
        back = pickle.loads(pickle.dumps(EngineFailure(error))).error
        assert type(back) is type(error) and str(back) == str(error)
        assert back.param == error.param and vars(back) == vars(error)


@pytest.mark.parametrize("code", [0, 3])
def test_receive_gives_the_message_or_names_the_exit_code(code: int) -> None:
    pipe, proc = spawn(says_then_exits, (code,), "canvas-test-child")
    try:
        if code == 0:
            assert receive(pipe, proc, time.monotonic() + 60) == ("ready", 42)
        else:
            with pytest.raises(ChildGone, match="exit code 3") as gone:
                receive(pipe, proc, time.monotonic() + 60)
            assert gone.value.exitcode == 3
    finally:
        hang_up(pipe)
        stop_child(proc, time.monotonic() + 10)


def test_a_hung_up_pipe_wakes_a_thread_reading_it_and_the_other_end() -> None:
    ours, theirs = multiprocessing.Pipe()
    woken: list[str] = []

    def read() -> None:
        try:
            ours.recv()
        except EOFError:
            woken.append("eof")

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.05)  # blocked in recv
    hang_up(ours)
    reader.join(5)
    assert woken == ["eof"] and ours.closed
    with pytest.raises(EOFError):
        theirs.recv()
    hang_up(ours)  # idempotent
