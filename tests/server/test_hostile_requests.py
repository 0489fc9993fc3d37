"""Bad requests never hurt anyone after them: out-of-range numbers are 400s naming the
parameter, on both routes and both numerics, and a fuzzed stream of numeric extremes leaves no
5xx, no in-band error, nothing held and every ordinary request after it answered."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from loadtest.load.fuzz import fuzz
from tests.server.conftest import LiveServer, start_server


@pytest.fixture(scope="module")
def small_server(tiny_checkpoint) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    server, stop = start_server(
        str(tiny_checkpoint("c16")), "--served-model-name", "tiny", "--max-num-seqs", "8"
    )
    yield server
    stop()


def _chat(**extra: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            **extra}  # fmt: skip


async def _burst(url: str, count: int) -> list[int]:
    async with httpx.AsyncClient(timeout=120.0) as client:
        answers = await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", json=_chat(seed=i)) for i in range(count))
        )
    return [r.status_code for r in answers]


@pytest.mark.parametrize(
    "field,value", [("entropy_bound", 1e308), ("t_max", 1e300), ("t_min", "inf"),
                    ("confidence_threshold", "1e999"), ("seed", 2**63)],
)  # fmt: skip
def test_an_out_of_range_number_is_a_400_naming_it(small_server: LiveServer, field, value) -> None:  # type: ignore[no-untyped-def]
    for route, body in (
        ("/v1/chat/completions", _chat(**{field: value})),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", field: value}),
    ):
        r = httpx.post(small_server.url + route, json=body, timeout=60)
        assert r.status_code == 400, (route, r.text)
        assert field in r.text


def test_two_out_of_range_floats_then_16_concurrent_requests_all_answer_200(
    small_server: LiveServer,
) -> None:
    """The regression: each of these once leaked a sampler slot until every admission failed."""
    for bad in (_chat(entropy_bound=1e308), _chat(t_max=1e300)):
        assert httpx.post(small_server.v1 + "/chat/completions", json=bad).status_code == 400
    assert asyncio.run(_burst(small_server.url, 16)) == [200] * 16
    assert small_server.metric("canvas:sampler_slots_used") == 0


def test_a_fuzzed_stream_of_numeric_extremes_leaves_no_5xx_and_nothing_held(
    small_server: LiveServer,
) -> None:
    result = asyncio.run(fuzz(small_server.url, "tiny", 300, seed=7, concurrency=8))
    assert result.server_errors == [] and result.in_band_errors == []
    assert result.statuses["200"] > 5 and result.statuses["400"] > 100  # some ran
    assert result.burst_statuses == [200] * 16
    assert result.held_after == {
        "vllm:num_requests_running": 0,
        "vllm:kv_cache_usage_perc": 0,
        "canvas:sampler_slots_used": 0,
    }


def test_top_p_and_top_k_are_served_on_both_routes(small_server: LiveServer) -> None:
    """Front ends send top_p by default: it is a per-request filter, never a 400."""
    for route, body in (
        ("/v1/chat/completions", _chat(top_p=0.9, top_k=40, seed=1)),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0.5, "max_tokens": 8}),
    ):
        r = httpx.post(small_server.url + route, json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_the_soak_sends_numeric_extremes_and_checks_what_is_held() -> None:
    """`make soak` draws hostile bodies from the fuzzer and reads the same gauges."""
    import random

    from loadtest.load import soak

    assert soak.held_after is not None and soak.body_for is not None
    route, body = soak.body_for(random.Random(0), "tiny")
    assert route.startswith("/v1/") and body["model"] == "tiny"
    assert any(changes.get("entropy_bound") == 1e308 for changes, _ in soak.REFUSED)
