"""Hybrid acceptance (`engine.verify`) on synthetic logits: greedy keeps the verifier's argmax,
and the speculative-sampling rule (q = the point mass on the drafted token) commits tokens
distributed as the verifier's p."""

from __future__ import annotations

import torch

from engine.batched_sampler import CounterDraws
from engine.params import DecodeMode, ResolvedParams
from engine.request import RequestState
from engine.verify import verify_draft

VOCAB = 8
# The chi-square critical value for 7 degrees of freedom at alpha = 0.001.
CHI2_CRITICAL_DF7 = 24.32


def _request(temperature: float, max_tokens: int = 10, eos: frozenset[int] = frozenset()):
    params = ResolvedParams(
        max_tokens=max_tokens,
        mode=DecodeMode.HYBRID,
        seed=0,
        eos_token_ids=eos,
        max_denoising_steps=2,
        entropy_bound=0.1,
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        temperature=temperature,
    )
    req = RequestState("r", [1, 2], params, context=32, canvas_length=3)
    req.output_ids = [5]  # the pending token
    return req


def _logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(3, VOCAB, generator=gen) * 1.5  # [L, V]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_commits_the_agreeing_prefix_and_the_verifiers_token():
    logits = _logits()
    best = logits.argmax(-1).tolist()
    req = _request(0.0)
    agree = verify_draft(req, [5, best[0], best[1]], logits, CounterDraws(0, logits.device))
    assert agree.tokens == best and agree.num_accepted == 2  # all accepted, plus the bonus token
    wrong = (best[0] + 1) % VOCAB
    disagree = verify_draft(req, [5, wrong, best[1]], logits, CounterDraws(0, logits.device))
    assert disagree.tokens == [best[0]] and disagree.num_accepted == 0


def test_verify_stops_at_eos_and_at_the_budget():
    logits = _logits()
    best = logits.argmax(-1).tolist()
    draft = [5, best[0], best[1]]
    ended = verify_draft(
        _request(0.0, eos=frozenset({best[0]})), draft, logits, CounterDraws(0, logits.device)
    )
    assert ended.tokens == [best[0]]
    cut = verify_draft(_request(0.0, max_tokens=2), draft, logits, CounterDraws(0, logits.device))
    assert cut.tokens == best[:1]  # max_tokens 2, one already committed


def test_speculative_rule_commits_the_verifiers_distribution():
    """4,000 verify passes with independent seeds over fixed logits at temperature 0.8: the
    first committed token follows p_0 and, when the proposal was accepted, the second follows
    p_1 (chi-square, 7 degrees of freedom, alpha 0.001). Power (by simulation, 2,000 repeats):
    a distribution at total-variation distance 0.05 from p_0 is rejected at this N with
    probability > 0.99 (the accepted branch's ~1,600 samples: a TV distance of 0.08)."""
    temperature = 0.8
    logits = _logits()
    probs = torch.softmax(logits / temperature, dim=-1)
    proposal = int(probs[0].argsort()[-2])  # p_0(proposal) well inside (0, 1): both branches
    draft = [5, proposal, int(probs[1].argmax())]
    req = _request(temperature)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    for seed in range(4000):
        result = verify_draft(req, draft, logits, CounterDraws(seed, logits.device))
        assert result.tokens is not None
        first[result.tokens[0]] += 1
        if result.tokens[0] == proposal:
            second[result.tokens[1]] += 1
    assert _chi_square(first, probs[0]) < CHI2_CRITICAL_DF7
    assert _chi_square(second, probs[1]) < CHI2_CRITICAL_DF7
    # The test can fail: the same counts against "always accept the proposal" do.
    always = torch.zeros(VOCAB)
    always[proposal] = 1.0
    skewed = 0.5 * probs[0] + 0.5 * always
    assert _chi_square(first, skewed) > CHI2_CRITICAL_DF7
