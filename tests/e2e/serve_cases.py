"""Helpers of the parallel serving tests (`tests/e2e/test_parallel_serve*.py`): a chat request
to a server, and TP=1's greedy answer compared with another's except at near ties."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from engine.model import load_model_config
from loadtest.load.inprocess import ServerHandle
from tests.e2e.parallel_cases import REL_TOL

TIMEOUT = httpx.Timeout(120.0)
# Greedy AR with the top two log-probabilities: what `assert_same_greedy` compares.
GREEDY = {"mode": "ar", "temperature": 0, "max_tokens": 24, "logprobs": True, "top_logprobs": 2}


def chat(server: ServerHandle, prompt: str, **body: Any) -> dict[str, Any]:
    request = {"model": server.model_name, "messages": [{"role": "user", "content": prompt}]}
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={**request, **body}, timeout=TIMEOUT
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def near_tie_bound(checkpoint: Path) -> float:
    """How close TP=1's top two logits must be for TP=2 to pick the other: each logit moves by
    at most REL_TOL x max |logit| (tests/e2e/parallel_cases.py), and the soft cap bounds
    |logit|; a log-probability gap is the logits' gap."""
    cap = load_model_config(checkpoint).text.final_logit_softcapping
    assert cap is not None
    return 2 * REL_TOL * cap


def assert_same_greedy(ours: dict[str, Any], ref: dict[str, Any], bound: float) -> None:
    """Two greedy AR answers (choices with log-probabilities, the top two) are the same text,
    or part first where `ref`'s top two log-probabilities lie within `bound`; until then each
    token's log-probability is within `bound` of `ref`'s (a logit and the normaliser each move
    by at most half of it)."""
    ours_steps, ref_steps = ours["logprobs"]["content"], ref["logprobs"]["content"]
    for i, (got, want) in enumerate(zip(ours_steps, ref_steps, strict=False)):
        if got["token"] != want["token"]:
            top = [t["logprob"] for t in want["top_logprobs"]]
            assert top[0] - top[1] <= bound, f"the answers part at token {i}, not a near tie"
            return
        assert abs(got["logprob"] - want["logprob"]) <= bound, f"token {i}'s log-probability"
    assert ours["message"]["content"] == ref["message"]["content"]
