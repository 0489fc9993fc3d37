"""A server that warms up (`engine.device.warmup`): /ready is 503 "warming up" until the warm-up
ends, /health stays 200 meanwhile (compiling is progress, not a stall, even past the stall
time), a request sent during the warm-up waits for it and is served after it, and what the
warm-up ran shows in no counter."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine import async_engine
from loadtest.load.inprocess import serve_in_thread
from tests.server.conftest import make_fake_server

PROMPT = [5, 6, 7]


def test_ready_waits_for_the_warm_up_and_a_request_sent_meanwhile_waits_too(
    tiny_checkpoint, monkeypatch
):
    real_warm_up = async_engine.warm_up
    release, warmed = threading.Event(), threading.Event()
    reports = []

    def gated_warm_up(engine, should_stop):
        assert release.wait(60), "the test never released the warm-up"
        reports.append(real_warm_up(engine, should_stop))
        warmed.set()
        return reports[-1]

    # On the CPU the warm-up is off by default: turn it on, and hold it until released.
    monkeypatch.setattr(async_engine, "wants_warmup", lambda engine: True)
    monkeypatch.setattr(async_engine, "warm_up", gated_warm_up)
    model = tiny_checkpoint("c16")
    with serve_in_thread(model, ["--served-model-name", "tiny", "--max-num-seqs", "2"]) as server:
        engine = server.state.engine
        ready = httpx.get(f"{server.url}/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "warming up"}
        assert httpx.get(f"{server.url}/ping").status_code == 503
        engine.stall_seconds = 0.0  # type: ignore[attr-defined]  # every wait is past it
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "mode": "ar"}
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
            time.sleep(0.5)
            assert not sent.done(), "a request was answered during the warm-up"
            assert engine.stats.num_inflight == 1
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            engine.stall_seconds = 60.0  # type: ignore[attr-defined]
            release.set()
            response = sent.result(60)
        assert warmed.is_set()
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}
        stats = engine.stats
        assert reports[0].num_steps > stats.num_steps  # the warm-up's steps are not counted
        assert stats.prefix_cache_queries == len(PROMPT)  # nor its prompts


def test_ready_names_the_warm_up_and_a_drain_takes_precedence():
    server = make_fake_server()
    with server.client as client:
        server.engine.warming_up = True
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "warming up"}
        assert client.get("/ping").status_code == 503
        assert client.get("/health").json() == {"status": "ok"}
        server.state.draining = True
        assert client.get("/ready").json() == {"status": "draining"}
        server.state.draining = server.engine.warming_up = False
        assert client.get("/ready").json() == {"status": "ready"}
