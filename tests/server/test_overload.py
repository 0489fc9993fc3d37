"""Overload and early exits: capacity is taken, and the engine has accepted the request, before
a stream's 200, so overload is always a real 429 with Retry-After and never an in-band error; a
client that leaves a non-streaming request aborts it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from engine.params import ParamError
from engine.types import QueueFull
from tests.server.conftest import LiveServer, start_server


def test_a_stream_into_a_full_engine_is_429_before_any_200(fake):
    fake.engine.queue_full = True
    r = fake.post("/completions", prompt="a", stream=True)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert not fake.engine.submitted


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_the_engine_finds_full_after_admission_is_429_before_any_200(fake, stream):
    fake.engine.refuse = QueueFull("2 requests running and 1 waiting")
    r = fake.post("/completions", prompt="a", n=2, stream=stream)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert fake.engine.num_inflight == 0 and fake.state.admission.num_admitted == 0


def test_a_stream_the_engine_refuses_as_invalid_is_400_not_an_in_band_error(fake):
    fake.engine.refuse = ParamError("max_tokens", "refused by the engine")
    r = fake.post("/chat/completions", messages=[{"role": "user", "content": "a"}], stream=True)
    assert r.status_code == 400, r.text
    assert "refused by the engine" in r.json()["error"]["message"]


def test_a_stream_refused_in_the_engine_threads_add_path_is_429_not_in_band(
    live_server, monkeypatch
):
    engine = live_server.state.engine

    def full(*args: object, **kwargs: object) -> None:
        raise QueueFull("the scheduler is full")

    monkeypatch.setattr(engine.engine, "add_request", full)  # runs on the engine thread
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8, "stream": True}
    r = httpx.post(f"{live_server.v1}/completions", json=body, timeout=30)
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert engine.num_inflight == 0 and live_server.state.admission.num_admitted == 0


async def _burst(url: str, model: str, num_clients: int, max_tokens: int) -> list[httpx.Response]:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"model": model, "prompt": [5, i + 3], "max_tokens": max_tokens, "stream": True}
        r = await client.post(f"{url}/completions", json=body, timeout=60)
        await r.aread()
        return r

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=num_clients)) as client:
        return list(await asyncio.gather(*(one(client, i) for i in range(num_clients))))


def _assert_real_statuses(responses: list[httpx.Response], capacity: int) -> None:
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == len(responses), [r.status_code for r in responses]
    assert all(r.headers["retry-after"] for r in refused)
    assert all('"error"' not in r.text and r.text.endswith("data: [DONE]\n\n") for r in ok)
    assert capacity <= len(ok) < len(responses)


def test_a_burst_of_streams_over_the_fake_gets_whole_streams_or_429s():
    from tests.server.conftest import make_fake_server

    server = make_fake_server()
    server.engine.delay = 0.05  # every stream is still running when the burst ends
    with server.client:
        transport = httpx.ASGITransport(app=server.client.app)  # type: ignore[arg-type]

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

                async def one(i: int) -> httpx.Response:
                    body = {"model": "fake", "prompt": "a", "seed": i, "stream": True}
                    return await client.post("/v1/completions", json=body)

                return list(await asyncio.gather(*(one(i) for i in range(20))))

        responses = asyncio.run(burst())
    _assert_real_statuses(responses, server.engine.limits.max_inflight)
    assert server.state.admission.num_admitted == 0


@pytest.fixture(scope="module")
def small_queue_server(tiny_checkpoint) -> Iterator[LiveServer]:
    server, stop = start_server(
        str(tiny_checkpoint("c16")),
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "2",
        "--max-queue",
        "1",
    )
    yield server
    stop()


def test_a_burst_of_streams_over_a_small_queue_gets_whole_streams_or_429s(small_queue_server):
    server = small_queue_server
    responses = asyncio.run(_burst(server.v1, server.model, num_clients=12, max_tokens=32))
    _assert_real_statuses(responses, server.state.engine.limits.max_inflight)


def test_a_non_streaming_client_that_leaves_aborts_its_request(live_server):
    engine = live_server.state.engine
    free_before = engine.engine.pages.num_unheld()
    aborts_before = _abort_count(live_server)
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{live_server.v1}/completions", json=body, timeout=1.0)  # then hangs up
    deadline = time.monotonic() + 5
    while engine.num_inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_inflight == 0
    while time.monotonic() < deadline and engine.engine.pages.num_unheld() != free_before:
        time.sleep(0.05)
    assert engine.engine.pages.num_unheld() == free_before
    assert _abort_count(live_server) == aborts_before + 1
    assert live_server.state.admission.num_admitted == 0


def _abort_count(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
