"""What peers' users hit, as regression tests on the tiny checkpoint: concurrent requests for
log-probabilities keep their own (exact numerics: each equal to the same request alone; fast:
each covers its own text, none lost), and a request's `max_denoising_steps` and
`entropy_bound` act on its canvases, never ignored."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

# Both modes in one batch; a few steps a canvas keeps the exact runs short.
MODES = ["diffusion", "ar"] * 6
BODY = {"model": "tiny", "max_tokens": 10, "logprobs": 2, "ignore_eos": True}


async def _complete(client: httpx.AsyncClient, url: str, i: int, mode: str) -> dict[str, Any]:
    prompt = [5 + i, 9 + 3 * i, 11] * (1 + i % 3)
    body = {**BODY, "prompt": prompt, "seed": 50 + i, "mode": mode, "max_denoising_steps": 4}
    r = await client.post(f"{url}/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def _alone_and_together(server: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient() as client:
            alone = [await _complete(client, server.v1, i, m) for i, m in enumerate(MODES)]
            together = await asyncio.gather(
                *(_complete(client, server.v1, i, m) for i, m in enumerate(MODES))
            )
        return alone, list(together)

    return asyncio.run(run())


def test_concurrent_logprob_requests_get_exactly_their_own_in_exact_numerics(exact_server):
    alone, together = _alone_and_together(exact_server)
    assert [c["text"] for c in together] == [c["text"] for c in alone]
    assert [c["logprobs"] for c in together] == [c["logprobs"] for c in alone]
    assert len({c["text"] for c in alone}) > len(MODES) // 2  # a swap would show


def test_concurrent_logprob_requests_never_swap_or_lose_logprobs_in_fast_numerics(live_server):
    _, together = _alone_and_together(live_server)
    for choice in together:
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 10
        # Keyed by the tokens' text: two ids that spell the same text share an entry.
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])


def _steps(server: Any, **extra: object) -> list[int]:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 32, "seed": 3, "ignore_eos": True}
    r = httpx.post(f"{server.v1}/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["canvas_stats"]["steps_per_canvas"]  # type: ignore[no-any-return]


def test_a_requests_denoising_steps_and_entropy_bound_act_on_its_canvases(live_server):
    assert _steps(live_server, max_denoising_steps=1) == [1, 1]
    capped = _steps(live_server, max_denoising_steps=3, confidence_threshold=0)
    assert capped == [3, 3]  # no early stop: the cap is what ends each canvas
    # A bound that accepts every position at once converges in fewer steps than one that
    # accepts a single position per step.
    loose = _steps(live_server, entropy_bound=1e6, max_denoising_steps=40)
    tight = _steps(live_server, entropy_bound=1e-9, max_denoising_steps=40)
    assert sum(loose) < sum(tight)
