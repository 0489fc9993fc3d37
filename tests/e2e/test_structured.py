"""Structured outputs and log-probabilities through the offline engine, on a tiny random-weight
checkpoint: a grammar must make any model's output valid, in both modes and both numerics."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from engine.llm import LLM
from engine.params import DecodeMode, ParamError, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "age": {"type": "integer"},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
        },
    },
    "required": ["name", "kind", "owner"],
}
MODES = [DecodeMode.DIFFUSION, DecodeMode.AR]
STEPS = 4  # few denoising steps: the grammar, not the model, is under test


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    return LLM.from_pretrained(tiny_checkpoint("c16"))


@pytest.fixture(scope="module")
def exact_llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    return LLM.from_pretrained(tiny_checkpoint("c16"), exact=True)


def _params(mode: DecodeMode, seed: int, **kw: object) -> SamplingParams:
    return SamplingParams(
        mode=mode,
        seed=seed,
        max_denoising_steps=STEPS,
        temperature=1.0,
        **kw,  # type: ignore[arg-type]
    )


def _check_valid(outs: list, schema: dict) -> None:  # type: ignore[type-arg]
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("mode", MODES)
def test_json_schema_outputs_validate_over_20_seeds(llm: LLM, mode: DecodeMode) -> None:
    schema = json.dumps(SCHEMA)
    params = [_params(mode, seed, max_tokens=120, json_schema=schema) for seed in range(20)]
    outs = llm.generate(["Describe a pet as JSON."] * 20, params)
    _check_valid(outs, SCHEMA)
    assert len({o.text for o in outs}) > 1  # the seeds differ: the model chose, not a template


@pytest.mark.parametrize("mode", MODES)
def test_json_object_outputs_parse(llm: LLM, mode: DecodeMode) -> None:
    schema = {"type": "object"}
    text = json.dumps(schema)
    params = [_params(mode, seed, max_tokens=64, json_schema=text) for seed in range(8)]
    outs = llm.generate(["Answer in JSON."] * 8, params)
    _check_valid(outs, schema)


@pytest.mark.parametrize("mode", MODES)
def test_exact_numerics_are_constrained_too(exact_llm: LLM, mode: DecodeMode) -> None:
    schema = json.dumps(SCHEMA)
    params = [_params(mode, seed, max_tokens=100, json_schema=schema) for seed in range(3)]
    _check_valid(exact_llm.generate(["pet"] * 3, params), SCHEMA)


@pytest.mark.parametrize("mode", MODES)
def test_budget_too_small_for_a_document_is_length(llm: LLM, mode: DecodeMode) -> None:
    # The shortest valid document is ~50 tokens of this byte-level tokenizer.
    out = llm.generate("pet", _params(mode, 0, max_tokens=10, json_schema=json.dumps(SCHEMA)))[0]
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_invalid_schemas_name_the_parameter(llm: LLM) -> None:
    for bad in ("{not json", '"a string"', '{"type": "objectx"}'):
        with pytest.raises(ParamError) as info:
            llm.generate("x", SamplingParams(max_tokens=8, json_schema=bad))
        assert info.value.param == "response_format"
    with pytest.raises(ParamError, match="ignore_eos"):
        llm.generate("x", SamplingParams(max_tokens=8, json_schema="{}", ignore_eos=True))


def test_constrained_and_free_requests_share_a_step(llm: LLM) -> None:
    free = _params(DecodeMode.DIFFUSION, 1, max_tokens=32)
    alone = llm.generate("free", free)[0]
    mixed = llm.generate(
        ["free", "pet"],
        [free, _params(DecodeMode.DIFFUSION, 2, max_tokens=120, json_schema=json.dumps(SCHEMA))],
    )
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)
    assert mixed[0].output_ids == alone.output_ids  # the free request is untouched


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_shape_and_values(llm: LLM, mode: DecodeMode) -> None:
    params = _params(mode, 7, max_tokens=40, logprobs=3)
    out = llm.generate("hi", params)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids)
    for entry, token in zip(out.logprobs, out.output_ids, strict=True):
        assert entry.token_id == token and entry.logprob <= 0
        values = [v for _, v in entry.top]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        if entry.logprob >= values[-1]:  # ranks within the top list: it is in it
            assert token in [t for t, _ in entry.top]
    again = llm.generate("hi", params)[0]
    assert again.logprobs == out.logprobs
    assert llm.generate("hi", _params(mode, 7, max_tokens=40))[0].logprobs is None


def test_diffusion_logprob_is_the_final_steps_argmax(llm: LLM) -> None:
    # Without a grammar a canvas commits its argmax draft: each token is its position's mode.
    out = llm.generate("hi", _params(DecodeMode.DIFFUSION, 3, max_tokens=32, logprobs=1))[0]
    assert out.logprobs is not None
    for entry in out.logprobs:
        assert entry.top[0][0] == entry.token_id
        assert entry.top[0][1] == pytest.approx(entry.logprob)
