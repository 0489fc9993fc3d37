"""The one request validator, shared by the server and the offline API (torch-free)."""

from __future__ import annotations

import re

import pytest

from engine.params import DecodeMode, DecodingDefaults, ParamError, SamplingParams
from engine.types import EngineLimits
from engine.validation import (
    ContextLengthError,
    RequestValidator,
    check_n,
    check_stop,
    context_needed,
)

LIMITS = EngineLimits(
    max_context_positions=100,
    vocab_size=50,
    canvas_length=8,
    max_num_seqs=2,
    max_inflight=4,
    max_fit_positions=80,
)
VALIDATOR = RequestValidator(DecodingDefaults(max_new_tokens=32), LIMITS)


def test_temperature_scales_the_diffusion_schedule():
    p = VALIDATOR.resolve(1, SamplingParams(max_tokens=8, temperature=0.5))
    assert (p.t_min, p.t_max, p.temperature) == (0.2, 0.4, 0.0)


def test_temperature_zero_is_nearly_greedy_denoising():
    p = VALIDATOR.resolve(1, SamplingParams(max_tokens=8, temperature=0.0))
    assert (p.t_min, p.t_max) == pytest.approx((0.004, 0.008))


def test_temperature_scales_explicit_schedule_ends_too():
    p = VALIDATOR.resolve(1, SamplingParams(max_tokens=8, t_min=0.2, t_max=1.0, temperature=2))
    assert (p.t_min, p.t_max) == (0.4, 2.0)


def test_temperature_is_the_sampling_temperature_in_ar_mode():
    p = VALIDATOR.resolve(1, SamplingParams(max_tokens=8, mode=DecodeMode.AR, temperature=0.7))
    assert (p.t_min, p.t_max, p.temperature) == (0.4, 0.8, 0.7)


def test_temperature_above_two_is_rejected_naming_it():
    with pytest.raises(ParamError, match=r"^temperature: must be in \[0, 2\]"):
        SamplingParams(temperature=2.5)


def test_the_default_budget_is_bounded_by_the_whole_canvases_left_in_context_and_kv():
    assert VALIDATOR.resolve(10, SamplingParams()).max_tokens == 32
    assert VALIDATOR.default_max_tokens(70) == 8  # (80 KV positions - 70) // 8 * 8
    assert VALIDATOR.default_max_tokens(75) == 0


def test_a_request_without_max_tokens_is_never_refused_for_max_tokens():
    """A chat without max_tokens on a small KV cache used to get a 400 blaming max_tokens,
    which the client never sent: the default now fits the KV cache, or the prompt is named."""
    assert VALIDATOR.resolve(60, SamplingParams()).max_tokens == 16  # fits 80 KV positions
    with pytest.raises(ParamError, match="leave no room for a completion") as info:
        VALIDATOR.resolve(75, SamplingParams())
    assert info.value.param == "prompt"


def test_diffusion_context_counts_whole_canvases_and_ar_counts_tokens():
    diffusion = VALIDATOR.resolve(1, SamplingParams(max_tokens=9))
    ar = VALIDATOR.resolve(1, SamplingParams(max_tokens=9, mode=DecodeMode.AR))
    assert context_needed(5, diffusion, 8) == 5 + 16
    assert context_needed(5, ar, 8) == 5 + 9


def test_a_context_over_the_model_limit_is_a_context_length_error():
    with pytest.raises(ContextLengthError) as info:
        VALIDATOR.resolve(90, SamplingParams(max_tokens=9))
    err = info.value
    assert (err.param, err.limit, err.num_prompt, err.num_completion) == ("max_tokens", 100, 90, 16)
    assert "prompt (90 tokens) + max_tokens (9) needs 106 positions" in str(err)
    assert "more than the model's context of 100" in str(err)


def test_a_context_the_kv_cache_cannot_hold_is_rejected():
    with pytest.raises(ParamError, match="88 positions do not fit in the KV cache") as info:
        VALIDATOR.resolve(80, SamplingParams(max_tokens=8))
    assert not isinstance(info.value, ContextLengthError)


def test_t_max_must_exceed_t_min_after_scaling():
    with pytest.raises(ParamError, match="t_max: must be > t_min"):
        VALIDATOR.resolve(1, SamplingParams(t_min=0.9, t_max=0.5, temperature=1.0))


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [([], "must contain at least one token"), ([3, 50], "token id 50 is outside")],
)
def test_bad_prompts_are_rejected_naming_the_prompt(prompt, fragment):
    with pytest.raises(ParamError, match=fragment) as info:
        VALIDATOR.validate(prompt, SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"


def test_request_shape_bounds_name_their_field():
    with pytest.raises(ParamError, match=r"^n: must be in \[1, 8\]"):
        check_n(9)
    with pytest.raises(ParamError, match="^stop: at most 4"):
        check_stop(["a"] * 5)
    check_n(8)
    check_stop(["a"] * 4)


def test_limits_refuse_a_kv_bound_beyond_the_context():
    with pytest.raises(ValueError, match="max_fit_positions"):
        EngineLimits(100, 50, 8, 2, 4, max_fit_positions=101)


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("temperature", 1e-45, "must be 0 (greedy) or >= 0.001"),
        ("t_max", 1e-45, "must be >= 0.001"),
        ("t_min", float("nan"), "must be a finite number"),
        ("entropy_bound", float("inf"), "must be a finite number"),
        ("temperature", float("nan"), "must be a finite number"),
    ],
)
def test_temperatures_that_would_overflow_the_softmax_are_refused_by_name(field, value, fragment):
    """A request with temperature 1e-45 used to pass, turn its logits into NaN and make the
    engine fail every request of its batch."""
    with pytest.raises(ParamError, match=re.escape(fragment)) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
