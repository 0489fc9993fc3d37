"""A CUDA error the GPU context does not survive (an illegal address, a device-side assert):
the engine does not re-run rows on the dead context; it fails every request with the error,
/health turns 503 with the reason, and `canvas serve` exits with EXIT_ENGINE_FAILED so that
Kubernetes restarts the pod. Out of memory stays a per-step failure. Checked on CPU with the
error injected into the model runner."""

from __future__ import annotations

import argparse
import threading
import time

import httpx
import pytest
import torch

import server.serve as serve_module
from server.cli.serve import add_serve_arguments
from server.serve import EXIT_ENGINE_FAILED, serve
from tests.server.conftest import make_fake_server, start_server
from tests.server.fake_engine import FakeEngine

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def _poison(engine, error: Exception) -> list[int]:  # type: ignore[no-untyped-def]
    """Make every forward raise `error`; returns a list that counts the forwards tried."""
    calls: list[int] = []

    def execute(step):  # type: ignore[no-untyped-def]
        calls.append(1)
        raise error

    engine.runner.execute = execute
    return calls


def _completion(url: str, out: list[httpx.Response], max_tokens: int) -> threading.Thread:
    body = {"model": "tiny", "prompt": "abc", "max_tokens": max_tokens, "ignore_eos": True}
    thread = threading.Thread(
        target=lambda: out.append(httpx.post(f"{url}/completions", json=body, timeout=30))
    )
    thread.start()
    return thread


def test_a_cuda_error_fails_the_requests_and_turns_health_503_with_the_reason(tiny_checkpoint):
    server, stop = start_server(str(tiny_checkpoint("c16")), "--served-model-name", "tiny")
    try:
        engine = server.state.engine.engine
        in_flight: list[httpx.Response] = []
        client = _completion(server.v1, in_flight, 4000)
        while server.state.engine.stats.num_running == 0:
            time.sleep(0.01)
        calls = _poison(engine, torch.AcceleratorError(ILLEGAL_ADDRESS))
        client.join(10)
        assert calls == [1]  # no row re-run on the dead context
        assert in_flight and in_flight[0].status_code == 500
        message = in_flight[0].json()["error"]["message"]
        assert "GPU context is lost" in message and "illegal memory access" in message
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "AcceleratorError" in health.json()["reason"]
        later: list[httpx.Response] = []
        _completion(server.v1, later, 2).join(10)
        assert later[0].status_code == 500 and "illegal memory access" in later[0].text
    finally:
        stop()


def test_out_of_memory_fails_only_that_step_and_the_engine_goes_on(tiny_checkpoint):
    server, stop = start_server(str(tiny_checkpoint("c16")), "--served-model-name", "tiny")
    try:
        engine = server.state.engine.engine
        execute = engine.runner.execute
        calls = _poison(engine, torch.cuda.OutOfMemoryError("CUDA out of memory"))
        failed: list[httpx.Response] = []
        _completion(server.v1, failed, 2).join(30)
        assert failed[0].status_code == 500 and len(calls) >= 2  # re-run one at a time
        engine.runner.execute = execute
        ok: list[httpx.Response] = []
        _completion(server.v1, ok, 2).join(30)
        assert ok[0].status_code == 200
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    finally:
        stop()


def test_canvas_serve_exits_with_engine_failed_once_the_engine_has_failed(monkeypatch):
    """`serve` stops its server by itself and returns EXIT_ENGINE_FAILED (the process's exit
    status) when the engine reports a failure; without one, /health answers 200."""
    engine = FakeEngine(failure="CUDA error, the GPU context is lost")
    state = make_fake_server(engine).state
    sock = serve_module.listen_socket("127.0.0.1", 0)
    monkeypatch.setattr(serve_module, "start", lambda args, threads: (sock, state, []))
    monkeypatch.setattr(serve_module, "freeze_heap", lambda: 0)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--port", "0", "--device", "cuda", "--drain-seconds", "30"])
    start = time.monotonic()
    assert serve(args) == EXIT_ENGINE_FAILED != 0
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("failure", ["", "CUDA error: unspecified launch failure"])
def test_health_names_the_failure(failure: str):
    server = make_fake_server(FakeEngine(failure=failure))
    with server.client:
        r = server.client.get("/health")
    if failure:
        assert r.status_code == 503 and r.json() == {"status": "unhealthy", "reason": failure}
    else:
        assert r.status_code == 200 and r.json() == {"status": "ok"}
