"""/health against the real async engine: when the step loop dies (a fault that escapes it
kills its thread), /health turns 503 within a second and stays 503, and no request hangs: the
one in flight and the ones after it end with an engine error."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server


class LoopKiller(BaseException):
    """A fault no `except Exception` catches."""


def _escape_from_step(engine, fault: BaseException, died: list[float]) -> None:  # type: ignore[no-untyped-def]
    def step():  # type: ignore[no-untyped-def]
        died.append(time.monotonic())
        raise fault

    engine.step = step


def _escape_from_the_loop(engine, fault: BaseException, died: list[float]) -> None:  # type: ignore[no-untyped-def]
    def has_work() -> bool:  # outside the step's own fault handling
        died.append(time.monotonic())
        raise fault

    engine.has_work = has_work


@pytest.mark.parametrize(
    ("inject", "fault"),
    [
        (_escape_from_step, SystemExit(3)),
        (_escape_from_step, LoopKiller("killed")),
        (_escape_from_the_loop, RuntimeError("escaped")),
    ],
    ids=["SystemExit-in-step", "BaseException-in-step", "Exception-outside-step"],
)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_turns_503_within_a_second_when_the_step_loop_dies_and_stays_503(
    tiny_checkpoint, inject, fault
):
    server, stop = start_server(str(tiny_checkpoint("c16")), "--served-model-name", "tiny")
    try:
        health = f"{server.url}/health"
        assert httpx.get(health).status_code == 200
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 4000, "ignore_eos": True}
        in_flight: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: in_flight.append(
                httpx.post(f"{server.v1}/completions", json=body, timeout=30)
            )
        )
        client.start()
        while server.state.engine.stats.num_running == 0:
            time.sleep(0.01)
        died: list[float] = []
        inject(server.state.engine.engine, fault, died)
        while httpx.get(health).status_code == 200:
            time.sleep(0.02)
        assert died and time.monotonic() - died[0] < 1.0
        for _ in range(10):  # and it stays down
            r = httpx.get(health)
            assert r.status_code == 503 and r.json() == {"status": "unhealthy"}
            time.sleep(0.05)
        client.join(10)
        assert in_flight and in_flight[0].status_code == 500, in_flight
        assert "step loop died" in in_flight[0].json()["error"]["message"]
        after = httpx.post(f"{server.v1}/completions", json={**body, "max_tokens": 2}, timeout=10)
        assert after.status_code == 500 and "step loop died" in after.json()["error"]["message"]
    finally:
        stop()
