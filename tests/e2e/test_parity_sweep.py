"""A fixed sample of the exact-numerics parity sweep (`tests.parity_sweep`; `make parity-sweep`
runs hundreds of cases): random configurations, both engines at one and two CPU threads."""

from __future__ import annotations

import pytest
import torch

from tests.parity_sweep import compare, random_case, sweep

# Cases chosen for spread: MHA and GQA, windows shorter and longer than the prompt, top-1 to
# top-3 routing, canvases of 8 to 32 tokens, one to three EOS ids.
SAMPLE = (0, 1, 2, 3)


def test_sample_of_random_configurations_matches_the_reference_at_one_and_two_threads():
    results = sweep(SAMPLE, threads=(1, 2))
    assert [r.mismatches for r in results] == [{}] * len(SAMPLE), [
        r.case.describe() for r in results if not r.ok
    ]


def test_sweep_cases_cover_what_the_issue_asks_for():
    cases = [random_case(i) for i in range(300)]
    texts = [c.text for c in cases]
    assert {t["num_hidden_layers"] for t in texts} == set(range(2, 13))
    assert min(c.canvas_length for c in cases) == 8 and max(c.canvas_length for c in cases) == 64
    assert any(len(c.prompt) > c.text["sliding_window"] for c in cases)
    assert any(len(c.prompt) < c.text["sliding_window"] for c in cases)
    assert {t["top_k_experts"] for t in texts} == {1, 2, 3, 4}
    assert any(t["num_key_value_heads"] == t["num_attention_heads"] for t in texts)  # MHA
    assert any(t["num_key_value_heads"] < t["num_attention_heads"] for t in texts)  # GQA
    assert all(t["global_head_dim"] != t["head_dim"] for t in texts)
    assert any(len(t["eos_token_id"]) == 3 for t in texts)
    assert random_case(7) == random_case(7)  # a case is the same in every run


@pytest.mark.parametrize("where", ["logits", "tokens"])
def test_sweep_comparison_catches_one_bit_and_one_token(where):
    logits = [torch.randn(8, 32) for _ in range(3)]
    ours = [t.clone() for t in logits]
    tokens = [5, 6, 7]
    got = list(tokens)
    if where == "logits":
        ours[1][3, 4] = torch.nextafter(ours[1][3, 4], torch.tensor(float("inf")))
    else:
        got[2] = 8
    assert compare(tokens, tokens, logits, [t.clone() for t in logits]) == ""
    problem = compare(tokens, got, logits, ours)
    assert ("decoder pass 1" if where == "logits" else "position 2") in problem
