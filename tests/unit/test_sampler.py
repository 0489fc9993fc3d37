"""Sampler pieces, commit rules and parameter validation (no model needed)."""

from __future__ import annotations

import pytest
import torch

from engine.modes import first_cut
from engine.params import DecodingDefaults, ParamError, SamplingParams
from engine.sampler import CanvasState, denoise_update, temperature, token_entropy


def test_temperature_schedule_is_linear_from_t_max_to_t_min():
    p = DecodingDefaults().resolve(SamplingParams(max_denoising_steps=4, t_min=0.4, t_max=0.8))
    temps = [float(temperature(p, n)) for n in (4, 3, 2, 1)]
    assert temps == pytest.approx([0.8, 0.7, 0.6, 0.5])


def test_token_entropy_equals_categorical_entropy():
    logits = torch.randn(3, 7, 50) * 4
    want = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.equal(token_entropy(logits), want)


def test_commit_cuts_at_first_eos_and_at_budget():
    assert first_cut([5, 6, 1, 7, 1], 10, frozenset({1})) == ([5, 6, 1], "stop")
    assert first_cut([5, 6, 7, 8], 3, frozenset({1})) == ([5, 6, 7], "length")
    assert first_cut([5, 6, 7, 8], 10, frozenset({1})) == ([5, 6, 7, 8], None)
    # An EOS after the budget does not count.
    assert first_cut([5, 6, 7, 1], 3, frozenset({1})) == ([5, 6, 7], "length")


def test_confident_stable_canvas_stops_and_unsure_one_does_not():
    p = DecodingDefaults().resolve(SamplingParams(max_denoising_steps=10, stability_threshold=1))
    peaked = torch.full((1, 4, 8), -30.0)
    peaked[0, torch.arange(4), torch.tensor([1, 2, 3, 4])] = 30.0
    state = CanvasState(
        canvas=torch.zeros(4, dtype=torch.long),
        generator=torch.Generator().manual_seed(0),
        steps_left=10,
        history=[torch.full((4,), -1)],
    )
    denoise_update(peaked, [state], [p])
    assert not state.finished  # not yet stable: the first draft has nothing to compare with
    assert state.canvas.tolist() == [1, 2, 3, 4]  # every confident position accepted
    denoise_update(peaked, [state], [p])
    assert state.finished and state.num_steps == 2
    flat = CanvasState(
        canvas=torch.zeros(4, dtype=torch.long),
        generator=torch.Generator().manual_seed(0),
        steps_left=10,
        history=[torch.full((4,), -1)],
    )
    for _ in range(3):
        denoise_update(torch.zeros(1, 4, 8), [flat], [p])
    assert not flat.finished and flat.steps_left == 7


def test_step_cap_finishes_the_canvas():
    p = DecodingDefaults().resolve(SamplingParams(max_denoising_steps=2))
    state = CanvasState(
        canvas=torch.zeros(4, dtype=torch.long), generator=torch.Generator(), steps_left=2
    )
    denoise_update(torch.zeros(1, 4, 8), [state], [p])
    assert not state.finished
    denoise_update(torch.zeros(1, 4, 8), [state], [p])
    assert state.finished


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"entropy_bound": 0.0}, "entropy_bound"),
        ({"t_min": -0.1}, "t_min"),
        ({"stability_threshold": -1}, "stability_threshold"),
        ({"confidence_threshold": -1.0}, "confidence_threshold"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_invalid_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(ParamError, match=f"^{param}: ") as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_t_max_must_exceed_t_min():
    with pytest.raises(ParamError, match="t_max: must be > t_min"):
        DecodingDefaults().resolve(SamplingParams(t_min=0.9, t_max=0.5))


def test_defaults_come_from_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        '{"max_denoising_steps": 12, "sampler_config": {"entropy_bound": 0.3, "_cls_name": "x"},'
        ' "t_min": 0.1, "t_max": 0.9, "eos_token_id": [1, 106], "max_new_tokens": 99}'
    )
    d = DecodingDefaults.from_checkpoint(tmp_path, eos_fallback=(1,))
    assert (d.max_denoising_steps, d.entropy_bound, d.t_min, d.t_max) == (12, 0.3, 0.1, 0.9)
    assert d.eos_token_ids == (1, 106) and d.max_new_tokens == 99
    r = d.resolve(SamplingParams(ignore_eos=True))
    assert r.eos_token_ids == frozenset() and r.max_tokens == 99
