"""The fault suite's property-based part and its storms: whatever a client sends to either
completion route, the answer is never a 5xx (on the fake engine, hundreds of bodies in a few
seconds); a storm of clients that leave mid-request (streaming and not) leaves no running,
waiting or KV state behind on the live server, which then serves a new request."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import FakeServer, make_fake_server

# Values of every JSON type, nested a little: what a careless or hostile client may send.
JSON_BODY = {"content-type": "application/json"}  # so the body is parsed, not refused as 415
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "seed", "n",
    "stop", "stream", "stream_options", "user", "mode", "max_denoising_steps", "entropy_bound",
    "t_min", "t_max", "stability_threshold", "confidence_threshold", "ignore_eos",
    "stream_drafts", "top_p", "logprobs", "tools", "response_format", "logit_bias",
]  # fmt: skip
GOOD = {
    "prompt": st.just("hello"),
    "messages": st.just([{"role": "user", "content": "hi"}]),
    "max_tokens": st.integers(1, 40),
    "temperature": st.floats(0, 2),
    "seed": st.integers(0, 2**40),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
}
BODIES = st.fixed_dictionaries(
    {"model": st.sampled_from(["fake", "other"])},
    optional={name: GOOD.get(name, JSON) | JSON for name in FIELDS},
)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[FakeServer]:
    server = make_fake_server()
    with server.client:
        yield server


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=BODIES)
def test_no_request_body_makes_a_5xx(fuzz_server: FakeServer, route: str, body: dict) -> None:
    r = fuzz_server.client.post(route, content=json.dumps(body), headers=JSON_BODY)
    assert r.status_code < 500, (r.status_code, r.text[:300], body)
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=200))
def test_no_raw_body_makes_a_5xx(raw: bytes) -> None:
    server = make_fake_server()
    with server.client:
        r = server.client.post("/v1/completions", content=raw, headers=JSON_BODY)
    assert r.status_code < 500, (r.status_code, r.text[:300], raw)


def test_a_storm_of_clients_that_leave_leaves_nothing_behind(live_server):
    """Ten streaming and ten non-streaming clients give up 0.3 s into their requests; then
    running, waiting and KV gauges return to 0 and a new request is served."""

    async def leave_early(client: httpx.AsyncClient, stream: bool) -> None:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "stream": stream}
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError, httpx.HTTPError):
            await asyncio.wait_for(
                client.post(f"{live_server.v1}/completions", json=body), timeout=0.3
            )

    async def storm() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(leave_early(client, i % 2 == 0) for i in range(20)))

    asyncio.run(storm())
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    for _ in range(100):  # aborts reach the engine thread within a step or two
        if all(live_server.metric(g) == 0 for g in gauges):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert [live_server.metric(g) for g in gauges] == [0, 0, 0]
    assert live_server.state.engine.num_inflight == 0
    r = httpx.post(
        f"{live_server.v1}/completions",
        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 8},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
