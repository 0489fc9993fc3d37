"""`"mode": "hybrid"` over HTTP on the tiny checkpoint: the same text as AR mode at temperature
0, streamed one chunk per committed span, `max_tokens` exact, the verifier's log-probabilities,
the acceptance metrics, and a 400 naming `mode` for a value that is not a mode."""

from __future__ import annotations

import json

import httpx

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 12, "temperature": 0, "seed": 1}


def _complete(server, **extra: object) -> dict:  # type: ignore[no-untyped-def,type-arg]
    r = httpx.post(f"{server.v1}/completions", json={**BODY, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_hybrid_completion_is_ar_text_with_the_verifiers_logprobs(live_server):
    ar = _complete(live_server, mode="ar", logprobs=1)
    hybrid = _complete(live_server, mode="hybrid", logprobs=1, max_denoising_steps=1)
    assert hybrid["choices"][0]["text"] == ar["choices"][0]["text"]
    assert hybrid["usage"]["completion_tokens"] == ar["usage"]["completion_tokens"] == 12
    assert hybrid["choices"][0]["logprobs"]["tokens"] == ar["choices"][0]["logprobs"]["tokens"]
    assert live_server.metric("canvas:hybrid_drafted_tokens_total") > 0
    assert live_server.metric("canvas:hybrid_accepted_tokens_count") >= 1


def test_hybrid_streams_committed_spans_cut_at_max_tokens(live_server):
    body = {**BODY, "mode": "hybrid", "stream": True, "max_tokens": 5, "max_denoising_steps": 1}
    with httpx.stream("POST", f"{live_server.v1}/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == _complete(live_server, mode="ar", max_tokens=5)["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_an_unknown_mode_is_a_400_naming_mode(live_server):
    r = httpx.post(f"{live_server.v1}/completions", json={**BODY, "mode": "speculative"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "mode" and "hybrid" in r.json()["error"]["message"]
