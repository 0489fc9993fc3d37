"""`--generation-config` and `--override-generation-config` reach the checkpoint through the
one build path (`engine.build.CheckpointConfig`): `LLM.from_pretrained`, `canvas generate`
and `canvas serve` load the same defaults, and a bad key stops each naming it."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.params import DecodingKnobs, ParamError
from server.cli import build_parser, main

OVERRIDE = '{"max_denoising_steps": 3, "t_min": 0.3}'


def test_llm_from_pretrained_takes_both(tiny_checkpoint):
    path = tiny_checkpoint("c16")
    llm = LLM.from_pretrained(
        path, generation_config="vllm", override_generation_config={"t_min": 0.3}
    )
    assert llm.defaults.max_new_tokens is None and llm.defaults.t_min == 0.3
    assert llm.defaults.t_max == DecodingKnobs().t_max
    assert llm.engine.validator.defaults is llm.defaults
    assert LLM.from_pretrained(path).defaults.max_new_tokens == 256


def test_canvas_serve_builds_its_defaults_from_the_flags(tiny_checkpoint):
    from server.serve import build_state

    path = str(tiny_checkpoint("c16"))
    parser, _ = build_parser()
    flags = ["--generation-config", "vllm", "--override-generation-config", OVERRIDE]
    args = parser.parse_args(["serve", "--model", path, "--port", "0", *flags])
    state, _ = build_state(args)
    try:
        assert state.defaults.max_new_tokens is None
        assert (state.defaults.max_denoising_steps, state.defaults.t_min) == (3, 0.3)
        assert state.validator.defaults is state.defaults
    finally:
        state.engine.shutdown()
    bad = parser.parse_args(
        ["serve", "--model", path, "--override-generation-config", '{"top_n": 3}']
    )
    with pytest.raises(ParamError, match="top_n"):
        build_state(bad)


def test_canvas_generate_runs_with_them_and_names_a_bad_key(tiny_checkpoint, capsys):
    path = str(tiny_checkpoint("c16"))
    argv = ["generate", "--model", path, "--prompt-ids", "5,9", "--max-tokens", "4"]
    assert (
        main([*argv, "--generation-config", "vllm", "--override-generation-config", OVERRIDE]) == 0
    )
    capsys.readouterr()
    bad = '{"sampler_config": {"entropy_bound": -1}}'
    assert main([*argv, "--override-generation-config", bad]) == 2
    assert "sampler_config.entropy_bound: must be > 0" in capsys.readouterr().err
