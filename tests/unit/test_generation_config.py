"""Where the decoding defaults come from (`--generation-config auto|canvas|vllm|DIR`) and the
keys set over them (`--override-generation-config`): `DecodingDefaults.from_checkpoint`, the
validator's default budget, and the flags that carry both onto `engine.build.CheckpointConfig`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.build import CheckpointConfig
from engine.modes import DecodeMode
from engine.params import DecodingDefaults, DecodingKnobs, ParamError, SamplingParams
from engine.types import EngineLimits
from engine.validation import RequestValidator
from server.cli.config import CHECKPOINT_FLAGS, add_flags, build_config

CHECKPOINT = {
    "max_new_tokens": 64,
    "max_denoising_steps": 7,
    "sampler_config": {"entropy_bound": 0.25},
    "t_min": 0.1,
    "t_max": 0.9,
    "stability_threshold": 3,
    "confidence_threshold": 0.0,
    "pad_token_id": 0,
    "eos_token_id": [2, 9],
    "canvas_default_mode": "hybrid",
    "canvas_hybrid_draft_steps": 4,
}


def write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def load(model_dir: Path, source: str | Path = "auto", **overrides) -> DecodingDefaults:
    return DecodingDefaults.from_checkpoint(model_dir, (1,), source, overrides or None)


def test_auto_reads_the_checkpoints_generation_config(tmp_path):
    d = load(write(tmp_path, CHECKPOINT))
    assert (d.max_new_tokens, d.max_denoising_steps, d.entropy_bound) == (64, 7, 0.25)
    assert (d.t_min, d.t_max, d.stability_threshold, d.confidence_threshold) == (0.1, 0.9, 3, 0)


def test_vllm_ignores_the_checkpoints_knobs_and_budget_but_keeps_its_token_ids_and_mode(
    tmp_path,
):
    d = load(write(tmp_path, CHECKPOINT), "vllm")
    reference = DecodingKnobs()
    for name in ("max_denoising_steps", "entropy_bound", "t_min", "t_max"):
        assert getattr(d, name) == getattr(reference, name), name
    assert (d.stability_threshold, d.confidence_threshold) == (1, reference.confidence_threshold)
    assert d.max_new_tokens is None  # no server-wide budget
    assert (d.eos_token_ids, d.pad_token_id) == ((2, 9), 0)
    assert (d.mode, d.hybrid_draft_steps) == (DecodeMode.HYBRID, 4)


def test_canvas_is_canvass_own_defaults_and_budget_with_the_checkpoints_token_ids_and_mode(
    tmp_path,
):
    d = load(write(tmp_path, CHECKPOINT), "canvas")
    own = DecodingDefaults()
    for name in ("max_new_tokens", "max_denoising_steps", "entropy_bound", "t_min", "t_max"):
        assert getattr(d, name) == getattr(own, name), name
    assert d.max_new_tokens == 256  # unlike vllm, a budget without max_tokens
    assert (d.eos_token_ids, d.pad_token_id) == ((2, 9), 0)
    assert (d.mode, d.hybrid_draft_steps) == (DecodeMode.HYBRID, 4)
    assert load(write(tmp_path, CHECKPOINT), "canvas", max_new_tokens=9).max_new_tokens == 9


def test_vllm_without_a_checkpoint_config_takes_the_models_eos_ids(tmp_path):
    d = load(tmp_path, "vllm")
    assert d.eos_token_ids == (1,) and d.max_new_tokens is None


def test_a_directory_replaces_the_checkpoints_generation_config(tmp_path):
    model = write(tmp_path / "model", CHECKPOINT)
    other = write(tmp_path / "other", {"max_new_tokens": 2048, "t_min": 0.3})
    d = load(model, other)
    assert (d.max_new_tokens, d.t_min, d.max_denoising_steps) == (2048, 0.3, 48)
    assert d.eos_token_ids == (1,)  # the other folder names none: the model's
    assert load(model, str(other)) == d
    with pytest.raises(FileNotFoundError, match="no generation_config.json in"):
        load(model, tmp_path / "empty")


def test_overrides_set_keys_over_what_was_loaded(tmp_path):
    model = write(tmp_path, CHECKPOINT)
    d = load(model, max_new_tokens=4096, t_min=0.3, sampler_config={"entropy_bound": 0.5})
    assert (d.max_new_tokens, d.t_min, d.entropy_bound) == (4096, 0.3, 0.5)
    assert (d.t_max, d.max_denoising_steps) == (0.9, 7)  # the rest: the checkpoint's
    v = load(model, "vllm", max_new_tokens=4096, eos_token_id=5)
    assert (v.max_new_tokens, v.eos_token_ids, v.t_min) == (4096, (5,), DecodingKnobs().t_min)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"temperature": 0.5}, "temperature"),
        ({"max_tokens": 10}, "max_tokens"),
        ({"sampler_config": {"entropy": 0.5}}, "sampler_config.entropy"),
        ({"entropy_bound": 0.5}, "entropy_bound"),  # spelled as the file nests it
    ],
)
def test_an_unknown_override_key_is_an_error_naming_it(tmp_path, overrides, key):
    with pytest.raises(ParamError, match="unknown generation config key") as err:
        load(write(tmp_path, CHECKPOINT), **overrides)
    assert err.value.param == key


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"t_min": "low"}, "t_min"),
        ({"t_min": -1}, "t_min"),
        ({"t_min": 0.95}, "t_max"),  # t_max must stay above it
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"max_denoising_steps": True}, "max_denoising_steps"),
        ({"max_denoising_steps": 100_000}, "max_denoising_steps"),
        ({"sampler_config": {"entropy_bound": -1}}, "sampler_config.entropy_bound"),
        ({"sampler_config": 0.5}, "sampler_config"),
        ({"confidence_threshold": float("nan")}, "confidence_threshold"),
        ({"canvas_default_mode": "fastest"}, "canvas_default_mode"),
        ({"canvas_hybrid_draft_steps": 0}, "canvas_hybrid_draft_steps"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
    ],
)
def test_a_bad_value_is_an_error_naming_its_key(tmp_path, overrides, key):
    with pytest.raises(ParamError) as err:
        load(write(tmp_path, CHECKPOINT), **overrides)
    assert err.value.param == key


def test_a_bad_value_in_the_loaded_file_is_an_error_naming_its_key(tmp_path):
    with pytest.raises(ParamError) as err:
        load(tmp_path, write(tmp_path / "other", {"stability_threshold": -2}))
    assert err.value.param == "stability_threshold"


def limits(positions: int) -> EngineLimits:
    return EngineLimits(
        canvas_length=16,
        max_context_positions=positions,
        max_fit_positions=positions,
        vocab_size=100,
        max_num_seqs=4,
        max_inflight=8,
    )


def test_without_max_new_tokens_a_request_may_use_the_whole_canvases_left(tmp_path):
    model = write(tmp_path, {**CHECKPOINT, "canvas_default_mode": "diffusion"})
    capped = RequestValidator(load(model), limits(1024))
    free = RequestValidator(load(model, "vllm"), limits(1024))
    assert capped.default_max_tokens(10) == 64
    assert free.default_max_tokens(10) == (1024 - 10) // 16 * 16
    assert free.validate([1] * 10, SamplingParams()).max_tokens == 1008
    assert free.default_max_tokens(1020) == 0


def test_resolving_without_max_tokens_or_max_new_tokens_names_max_tokens(tmp_path):
    with pytest.raises(ParamError) as err:
        load(tmp_path, "vllm").resolve(SamplingParams())
    assert err.value.param == "max_tokens"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, CHECKPOINT_FLAGS)
    return parser.parse_args(argv)


def test_the_flags_map_onto_the_checkpoint_record():
    assert build_config(parse(), None, CHECKPOINT_FLAGS).checkpoint.generation_config == "auto"
    overrides = '{"max_new_tokens": 4096, "sampler_config": {"entropy_bound": 0.2}}'
    args = parse("--generation-config", "vllm", "--override-generation-config", overrides)
    checkpoint = build_config(args, None, CHECKPOINT_FLAGS).checkpoint
    assert checkpoint.generation_config == "vllm"
    assert checkpoint.override_generation_config == json.loads(overrides)
    assert CheckpointConfig().override_generation_config is None


@pytest.mark.parametrize("text", ["{", "[1]", '"x"'])
def test_an_override_that_is_not_a_json_object_is_refused_by_the_parser(text, capsys):
    with pytest.raises(SystemExit):
        parse("--override-generation-config", text)
    assert "--override-generation-config" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["diffusion", "ar", "hybrid"])
def test_the_whole_budget_left_fits_the_context_in_every_mode(tmp_path, mode):
    free = RequestValidator(load(tmp_path, "vllm"), limits(1024))
    resolved = free.validate([1] * 10, SamplingParams(mode=mode))  # no ContextLengthError
    assert resolved.max_tokens > 1024 - 10 - 2 * 16
