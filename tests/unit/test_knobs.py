"""The decoding knobs are one record (`engine.params.DecodingKnobs`): every test here loops over
its fields, so a knob added to the record that one place forgets (a request field, `resolve`,
the checkpoint's defaults, the sampler's slots) fails here, naming the knob."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

import kernels
from engine.batched_sampler import BatchedSampler
from engine.logits.filters import top_p_floor
from engine.params import (
    KNOB_NAMES,
    DecodeMode,
    DecodingDefaults,
    DecodingKnobs,
    ResolvedParams,
    SamplingParams,
)
from server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULTS = DecodingDefaults()


BIAS = ((5, 2.0),)  # a logit_bias as the knob holds it


def other_value(name: str) -> object:
    """A valid value of knob `name` that differs from its default (t_max stays above t_min)."""
    default = next(f.default for f in fields(DecodingKnobs) if f.name == name)
    if name == "logit_bias":
        return BIAS
    if isinstance(default, int):
        return default + 1
    return default * 0.75 if default else 0.5


def knobs_of(params: ResolvedParams | DecodingDefaults) -> dict[str, object]:
    return {name: getattr(params, name) for name in KNOB_NAMES}


def slot_values(sampler: BatchedSampler, slot: int) -> dict[str, object]:
    state = sampler.state
    values: dict[str, object] = {
        name: state.knobs[name][slot].item() for name in KNOB_NAMES if name != "logit_bias"
    }
    biases = state.knobs["logit_bias"][slot].tolist()
    pairs = zip(state.bias_ids[slot].tolist(), biases, strict=True)
    values["logit_bias"] = tuple((token, bias) for token, bias in pairs if bias)
    return values


def as_slot(knobs: dict[str, object]) -> dict[str, object]:
    """What the slots hold for these (AR mode) knobs, rounded as the slot tensors round them
    (logit_bias: its pairs, as `slot_values` reads them)."""
    held = {**knobs, "top_p": top_p_floor(float(knobs["top_p"]))}  # type: ignore[arg-type]
    return {
        name: value
        if name == "logit_bias"
        else torch.tensor(
            value, dtype=torch.float32 if isinstance(value, float) else torch.long
        ).item()
        for name, value in held.items()
    }


def make_sampler() -> BatchedSampler:
    embedding = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    return BatchedSampler(kernels.resolve_kernels("cpu", "twins"), embedding, 1.0, 4, 2)


def test_the_knobs_are_the_fields_of_resolved_params_and_of_the_defaults():
    for record in (ResolvedParams, DecodingDefaults):
        assert issubclass(record, DecodingKnobs)
    for name in KNOB_NAMES:
        assert SamplingParams.__dataclass_fields__[name].default is None, name


@pytest.mark.parametrize("name", KNOB_NAMES)
def test_a_requested_knob_is_carried_through_resolve_into_its_slot(name):
    value = other_value(name)
    resolved = DEFAULTS.resolve(SamplingParams(mode=DecodeMode.AR, **{name: value}))
    want = {**knobs_of(DEFAULTS), name: value}
    assert knobs_of(resolved) == want  # and no other knob moved
    sampler = make_sampler()
    sampler.bind(1, 7, resolved)
    assert slot_values(sampler, 1) == as_slot(want)


@pytest.mark.parametrize("name", KNOB_NAMES)
def test_a_knob_the_request_leaves_out_takes_the_checkpoint_default(name):
    value = other_value(name)
    defaults = DecodingDefaults(**{name: value})
    resolved = defaults.resolve(SamplingParams(mode=DecodeMode.AR))
    assert knobs_of(resolved) == {**knobs_of(DEFAULTS), name: value}


@pytest.mark.parametrize("request_model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("name", KNOB_NAMES)
def test_every_knob_is_a_request_field_carried_into_sampling_params(request_model, name):
    value = other_value(name)
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    if request_model is CompletionRequest:
        del body["messages"]
    else:
        del body["prompt"]
    sent = {"5": 2.0} if name == "logit_bias" else value  # JSON keys are strings
    params = request_model(**body, **{name: sent}).sampling_params(None)
    assert {n: getattr(params, n) for n in KNOB_NAMES} == {
        n: value if n == name else None for n in KNOB_NAMES
    }


def test_checkpoint_defaults_are_read_from_their_generation_config_keys(tmp_path):
    config = {
        "max_new_tokens": 5,
        "max_denoising_steps": 7,
        "sampler_config": {"entropy_bound": 0.25, "_cls_name": "EntropyBoundSamplerConfig"},
        "t_min": 0.1,
        "t_max": 0.9,
        "stability_threshold": 3,
        "confidence_threshold": 0.0,  # falsy, still read
        "pad_token_id": 0,
        "eos_token_id": 2,
        "canvas_default_mode": "hybrid",
        "canvas_hybrid_draft_steps": 4,
        # Sampling keys of Hugging Face generation configs: not Canvas' defaults.
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 0.9,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    d = DecodingDefaults.from_checkpoint(tmp_path, eos_fallback=(1,))
    assert d == DecodingDefaults(
        max_new_tokens=5,
        max_denoising_steps=7,
        entropy_bound=0.25,
        t_min=0.1,
        t_max=0.9,
        stability_threshold=3,
        confidence_threshold=0.0,
        pad_token_id=0,
        eos_token_ids=(2,),
        mode=DecodeMode.HYBRID,
        hybrid_draft_steps=4,
    )
    assert d.resolve(SamplingParams()).max_denoising_steps == 4  # hybrid: the draft's steps


def test_a_checkpoint_without_generation_config_has_the_reference_defaults(tmp_path):
    assert DecodingDefaults.from_checkpoint(tmp_path, eos_fallback=(1,)) == DecodingDefaults(
        eos_token_ids=(1,)
    )
