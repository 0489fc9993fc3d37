"""Hybrid's draft policy: the step-cost fit, the decisions it drives, and that a loaded,
compute-bound server stops drafting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.draft_policy import DraftPolicy, StepCost


def seq(accept: float | None = None, since: int = 0, steps: int = 1, length: int = 32):
    params = SimpleNamespace(max_denoising_steps=steps)
    return SimpleNamespace(
        params=params, canvas_length=length, accept_average=accept, tokens_since_draft=since
    )


def test_the_step_cost_fit_recovers_fixed_and_per_token_costs():
    cost = StepCost()
    assert cost.fit() is None and cost.canvas_cost(32, 1) is None  # nothing seen yet
    for _ in range(10):
        cost.observe(16, 0.020 + 16 * 0.001)
    assert cost.fit() is None  # the token count never varied: no slope to fit
    for tokens in (16, 48, 16, 80, 16, 48) * 5:
        cost.observe(tokens, 0.020 + tokens * 0.001)
    fixed, per_token = cost.fit()  # type: ignore[misc]
    assert fixed == pytest.approx(0.020) and per_token == pytest.approx(0.001)
    # alone: (20 + 32) / (20 + 1) ms; with 16 running the fixed part is shared: (1.25 + 32) / 2.25
    assert cost.canvas_cost(32, 1) == pytest.approx(52 / 21)
    assert cost.canvas_cost(32, 16) == pytest.approx(33.25 / 2.25)


def test_a_fit_without_a_fixed_part_is_all_per_token():
    cost = StepCost()
    for tokens in (1, 32, 1, 32):
        cost.observe(tokens, tokens * 0.002 - 0.001 * (tokens == 1))  # a negative intercept
    fixed, per_token = cost.fit()  # type: ignore[misc]
    assert fixed == 0.0 and per_token > 0 and cost.canvas_cost(32, 4) == pytest.approx(32)


def test_drafting_decisions():
    policy = DraftPolicy(probe_every=4)
    # A fresh request drafts when a draft could pay at all, and its prior decides otherwise.
    assert policy.drafts(seq(), canvas_cost=1.0)
    assert not policy.drafts(seq(), canvas_cost=1.0, prior=0.5)  # 1.5 < a cycle of 2
    assert policy.drafts(seq(), canvas_cost=1.0, prior=1.0)
    # Its own acceptance overrides the prior.
    assert policy.drafts(seq(accept=3.0), canvas_cost=1.0, prior=0.0)
    assert not policy.drafts(seq(accept=0.2), canvas_cost=1.0, prior=9.0)
    # A request that does not draft probes after probe_every cycles' worth of AR tokens.
    assert not policy.drafts(seq(accept=0.2, since=7), canvas_cost=1.0)
    assert policy.drafts(seq(accept=0.2, since=8), canvas_cost=1.0)
    assert not policy.drafts(seq(accept=0.2, since=8), canvas_cost=2.0)  # 16 needed now
    # When a canvas accepted whole could not pay, nobody drafts: not first, not to probe.
    assert not policy.drafts(seq(), canvas_cost=17.0)  # 2 passes x 17 > 32 tokens
    assert not policy.drafts(seq(accept=31, since=10**6), canvas_cost=17.0)
    assert policy.drafts(seq(steps=3), canvas_cost=8.0)  # 4 x 8 = 32: a whole canvas pays
    with pytest.raises(ValueError):
        DraftPolicy(canvas_cost=0)
