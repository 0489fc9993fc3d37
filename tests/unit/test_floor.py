"""The benchmark's FLOP floor (`loadtest.cpu.floor`): what a canvas and a prompt cost."""

from __future__ import annotations

import pytest

from engine.model import load_model_config
from engine.model.config import TextConfig
from loadtest.cpu.floor import Floor, attention_flops, canvas_flops, prompt_flops, token_flops


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint) -> TextConfig:
    return load_model_config(tiny_checkpoint("c16")).text


def test_a_prompts_prefill_is_its_tokens_through_the_encoder_and_causal_attention(cfg):
    assert prompt_flops(cfg, 0) == 0
    want = 40 * token_flops(cfg, decode=False) + attention_flops(cfg, 40, 40) / 2
    assert prompt_flops(cfg, 40) == pytest.approx(want)
    assert prompt_flops(cfg, 80) > 2 * prompt_flops(cfg, 40) - 1  # attention grows faster


def test_the_floor_counts_the_prompts_share_and_the_decode_floor_does_not(cfg):
    canvas = canvas_flops(cfg, 16, 50, 4)
    share = prompt_flops(cfg, 40) / 2
    floor = Floor(1e11, canvas, 16, share)
    assert floor.decode_tokens_per_s == pytest.approx(16 * 1e11 / canvas)
    assert floor.tokens_per_s == pytest.approx(16 * 1e11 / (canvas + share))
    report = floor.to_dict()
    assert report["floor_tokens_per_s"] < report["decode_floor_tokens_per_s"]
    assert report["gflops_prompt_per_canvas"] == pytest.approx(share / 1e9)
    assert Floor(1e11, canvas, 16).tokens_per_s == floor.decode_tokens_per_s


def test_each_rounds_floor_is_at_its_own_rate(cfg):
    floor = Floor(1e11, canvas_flops(cfg, 16, 50, 4), 16, 1e6).with_round_rates([1e11, 3e11, 2e11])
    assert floor.gemm_flop_per_s == 2e11  # the median is the headline
    report = floor.to_dict()
    assert report["gemm_gflop_per_s_per_round"] == [100, 300, 200]
    per_round = report["floor_tokens_per_s_per_round"]
    assert per_round[1] == pytest.approx(3 * per_round[0])
    assert report["floor_tokens_per_s"] == pytest.approx(per_round[2])
    assert (
        Floor(1e11, 1e9, 16).with_round_rates([]).to_dict().keys()
        == Floor(1e11, 1e9, 16).to_dict().keys()
    )
