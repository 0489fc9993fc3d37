"""Many clients at once: batch invariance, disconnects, overload, load; auth."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import start_server


async def _complete(
    client: httpx.AsyncClient, url: str, prompt: list[int], seed: int, max_tokens: int
) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "seed": seed}
    body["max_denoising_steps"] = 4  # a few steps per canvas: invariance does not depend on it
    r = await client.post(f"{url}/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def test_sixteen_concurrent_requests_equal_their_one_at_a_time_outputs(exact_server):
    live_server = exact_server  # batch invariance is a property of exact numerics
    prompts = [[3 + i, 40 + 2 * i, 7] * (1 + i % 4) for i in range(16)]
    seeds = list(range(100, 116))
    budgets = [6 + 4 * i for i in range(16)]  # 1 to 5 canvases: they leave at different steps

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient() as client:
            alone = [
                await _complete(client, live_server.v1, p, s, m)
                for p, s, m in zip(prompts, seeds, budgets, strict=True)
            ]
            together = await asyncio.gather(
                *(
                    _complete(client, live_server.v1, p, s, m)
                    for p, s, m in zip(prompts, seeds, budgets, strict=True)
                )
            )
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone


def test_client_disconnect_aborts_the_request_and_frees_its_pages(live_server):
    engine = live_server.state.engine.engine
    free_before = engine.pages.num_unheld()
    body = {
        "model": "tiny",
        "prompt": "abc",
        "max_tokens": 4000,
        "stream": True,
        "extra_body": None,
    }
    body.pop("extra_body")
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{live_server.v1}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:") and '"text":"' in line and '"text":""' not in line:
                break  # first committed canvas arrived: the request is running
        assert live_server.metric("vllm:num_requests_running") == 1  # this one, mid-answer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if (
            live_server.metric("vllm:num_requests_running") == 0
            and engine.pages.num_unheld() == free_before
        ):
            break
        time.sleep(0.1)
    assert live_server.metric("vllm:num_requests_running") == 0
    assert engine.pages.num_unheld() == free_before
    assert not engine.requests


def test_sixty_four_concurrent_streams_complete_while_health_answers(live_server):
    async def stream_one(client: httpx.AsyncClient, i: int) -> str:
        body = {"model": "tiny", "prompt": [5, i + 3], "max_tokens": 40, "seed": i, "stream": True}
        text = ""
        async with client.stream(
            "POST", f"{live_server.v1}/completions", json=body, timeout=300
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    assert '"error"' not in line, line
                    text += line
        return text

    async def health_probe(stop: asyncio.Event) -> list[int]:
        codes = []
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                codes.append(
                    (await client.get(f"{live_server.url}/health", timeout=10)).status_code
                )
                await asyncio.sleep(0.2)
        return codes

    async def run() -> tuple[list[str], list[int]]:
        stop = asyncio.Event()
        probe = asyncio.create_task(health_probe(stop))
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(limits=limits) as client:
            results = await asyncio.gather(*(stream_one(client, i) for i in range(64)))
        stop.set()
        return list(results), await probe

    results, codes = asyncio.run(run())
    assert len(results) == 64 and all(results)
    assert codes and all(c == 200 for c in codes)


@pytest.fixture(scope="module")
def small_server(tiny_checkpoint):
    server, stop = start_server(
        str(tiny_checkpoint("c16")),
        "--served-model-name",
        "tiny",
        "--max-num-seqs",
        "1",
        "--max-queue",
        "1",
        "--api-key",
        "sekrit",
    )
    yield server
    stop()


def test_full_queue_is_429_with_retry_after(small_server):
    headers = {"authorization": "Bearer sekrit"}
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 8000, "ignore_eos": True}
    engine = small_server.state.engine

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(headers=headers, timeout=120) as client:
            url = f"{small_server.v1}/completions"
            tasks = [asyncio.create_task(client.post(url, json=body)) for _ in range(2)]
            deadline = time.monotonic() + 20
            while engine.num_inflight < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # one running (max-num-seqs 1), one queued (max-queue 1)
            third = await client.post(url, json=body)
            for t in tasks:
                t.cancel()
            return third

    third = asyncio.run(run())
    assert third.status_code == 429
    assert third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "queue_full"


def test_api_key_is_required_on_v1_but_not_on_health(small_server):
    assert httpx.get(f"{small_server.v1}/models").status_code == 401
    assert (
        httpx.get(
            f"{small_server.v1}/models", headers={"authorization": "Bearer wrong"}
        ).status_code
        == 401
    )
    assert (
        httpx.get(
            f"{small_server.v1}/models", headers={"authorization": "Bearer sekrit"}
        ).status_code
        == 200
    )
    assert httpx.get(f"{small_server.url}/health").status_code == 200


def test_sigterm_drains_before_exit(small_server):
    """The first signal flips /ready to 503 and refuses new completions; requests keep running."""
    import signal

    import uvicorn

    from server.serve import draining_server

    state = small_server.state
    server = draining_server(state, uvicorn.Config(app=None), drain_seconds=30)
    try:
        server.handle_exit(signal.SIGTERM, None)
        assert state.draining and not server.should_exit
        assert httpx.get(f"{small_server.url}/ready").status_code == 503
        r = httpx.post(
            f"{small_server.v1}/completions",
            json={"model": "tiny", "prompt": "a"},
            headers={"authorization": "Bearer sekrit"},
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        server.handle_exit(signal.SIGTERM, None)  # a second signal exits at once
        assert server.should_exit
    finally:
        state.draining = False


def test_oversized_body_is_413(live_server):
    r = httpx.post(
        f"{live_server.v1}/completions",
        content=b"x" * (5 << 20),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]


def test_engine_fault_mid_stream_is_reported_in_band(live_server):
    engine = live_server.state.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():  # the third step of this request fails inside the engine
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = flaky_step
    try:
        body = {
            "model": "tiny",
            "prompt": "abc",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{live_server.v1}/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
    finally:
        engine.step = real_step
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "internal engine error" in lines[-2]


def test_requests_sharing_an_x_request_id_both_complete_and_leak_nothing(live_server):
    """A duplicate x-request-id used to key both requests in the engine: the first hung
    forever, its in-flight slot leaked, and later requests got 429s."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 20, "seed": 1}
            return list(
                await asyncio.gather(
                    *(
                        client.post(
                            f"{live_server.v1}/completions",
                            json=body,
                            headers={"x-request-id": "same-id"},
                        )
                        for _ in range(2)
                    )
                )
            )

    first, second = asyncio.run(run())
    assert first.status_code == second.status_code == 200
    assert first.json()["id"] != second.json()["id"]
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in (first, second))
    assert live_server.state.engine.num_inflight == 0


def test_a_poisoned_request_fails_alone_while_the_others_are_served(live_server):
    """A fault in one request's row used to fail every running request (500s for innocent
    clients); now the step is re-run row by row and only the poisoned request fails."""
    engine = live_server.state.engine.engine
    execute, poison = engine.runner.execute, 99

    def faulty(step):  # type: ignore[no-untyped-def]
        if any(poison in e.tokens for e in step.encode):
            raise RuntimeError("injected fault")
        return execute(step)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            prompts = [[5, 6, 7], [8, poison, 9], [10, 11], [12, 13, 14]]
            return list(
                await asyncio.gather(
                    *(
                        client.post(
                            f"{live_server.v1}/completions",
                            json={"model": "tiny", "prompt": p, "max_tokens": 16, "seed": 2},
                        )
                        for p in prompts
                    )
                )
            )

    engine.runner.execute = faulty
    try:
        responses = asyncio.run(run())
    finally:
        engine.runner.execute = execute
    assert [r.status_code for r in responses] == [200, 500, 200, 200]
    assert "internal engine error" in responses[1].json()["error"]["message"]
    assert live_server.state.engine.num_inflight == 0
