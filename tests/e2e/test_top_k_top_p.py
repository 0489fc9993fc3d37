"""top_k / top_p in both decoding modes and both numerics (`engine.logits.filters`)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import LLM, DecodeMode, ParamError, SamplingParams
from engine.logits.batched import process_rows_
from engine.logits.filters import top_p_floor
from tests.e2e.filter_cases import filter_logits, request
from tests.e2e.parity_cases import expected_prefix, prompts_for, reference_generate


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.9), (7, 0.8), (50, 0.3), (1, 0.5)])
def test_the_filter_is_the_references_warpers_bit_for_bit(k: int, p: float) -> None:
    x = torch.randn(33, 500, generator=torch.Generator().manual_seed(k)) * 3
    want = x
    if k:
        want = TopKLogitsWarper(k)(None, want)
    if p < 1:
        want = TopPLogitsWarper(p)(None, want)
    floor = torch.full((33,), top_p_floor(p), dtype=torch.float32)
    assert torch.equal(filter_logits(x, torch.full((33,), k), floor, k, p < 1), want)


def test_rows_of_one_batch_keep_their_own_filters() -> None:
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)) * 3
    k, floor = torch.tensor([0, 4, 0]), torch.tensor([0.0, 0.0, top_p_floor(0.5)])
    out = filter_logits(x, k, floor, 4, True)
    assert torch.equal(out[0], x[0])  # neither filter
    assert int(torch.isfinite(out[1]).sum()) == 4
    alone = TopPLogitsWarper(0.5)(None, x[2:3])
    assert torch.equal(out[2:3], alone)


class PerPosition:
    """A warper applied to [positions, V]: the reference's diffusion logits are [B, L, V], and
    `TopPLogitsWarper` scatters along dim 1 (it is written for [B, V])."""

    def __init__(self, warper: object) -> None:
        self.warper = warper

    def __call__(self, input_ids: object, scores: torch.Tensor) -> torch.Tensor:
        flat = scores.reshape(-1, scores.shape[-1])
        return self.warper(input_ids, flat).view_as(scores)  # type: ignore[operator]


def test_exact_diffusion_matches_the_reference_with_its_warpers(tiny_checkpoint, reference_model):
    path = tiny_checkpoint("c16")
    ref, llm = reference_model(path), LLM.from_pretrained(path, exact=True)
    eos = set(llm.defaults.eos_token_ids)
    settings = ((20, 1.0), (0, 0.7), (40, 0.9))  # top_k alone, top_p alone, both
    for seed, (prompt, (k, p)) in enumerate(zip(prompts_for(llm)[:3], settings, strict=True)):
        warpers = [PerPosition(TopKLogitsWarper(k))] if k else []
        warpers += [PerPosition(TopPLogitsWarper(p))] if p < 1 else []
        ref_ids, _ = reference_generate(
            ref, prompt, seed, max_new_tokens=24, logits_processor=LogitsProcessorList(warpers)
        )
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=24, seed=seed, top_k=k, top_p=p))
        assert out.output_ids == expected_prefix(ref_ids, eos, 24), (seed, k, p)


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@pytest.mark.parametrize("mode", [DecodeMode.DIFFUSION, DecodeMode.AR])
def test_filters_reproduce_by_seed_and_neutral_values_change_nothing(
    tiny_checkpoint, exact, mode
) -> None:
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), exact=exact)
    prompt = [5, 6, 7, 8]
    base = dict(max_tokens=20, seed=3, mode=mode, temperature=1.0, max_denoising_steps=4)
    free = llm.generate(prompt, SamplingParams(**base))[0].output_ids  # type: ignore[arg-type]
    neutral = SamplingParams(**base, top_k=-1, top_p=1.0)  # type: ignore[arg-type]
    assert llm.generate(prompt, neutral)[0].output_ids == free
    narrow = SamplingParams(**base, top_k=3, top_p=0.5)  # type: ignore[arg-type]
    first, again = (llm.generate(prompt, narrow)[0].output_ids for _ in range(2))
    assert first == again
    if mode is DecodeMode.AR:  # top_k = 1 at any temperature is greedy
        one = llm.generate(prompt, SamplingParams(**base, top_k=1))[0].output_ids  # type: ignore[arg-type]
        greedy = llm.generate(prompt, SamplingParams(**{**base, "temperature": 0.0}))  # type: ignore[arg-type]
        assert one == greedy[0].output_ids


def test_fast_top_k_1_draws_the_argmax_at_every_position() -> None:
    """One candidate per position: zero entropy, so every position is accepted, and what it
    takes is the argmax (the draft); an unfiltered row of the same batch keeps noise."""
    from tests.e2e.sampler_cases import make_sampler, resolved

    length, vocab = 16, 300
    sampler = make_sampler(2, length, vocab, hidden=8)
    params = [resolved(1, top_k=1), resolved(2, entropy_bound=0.01)]
    for slot, p in enumerate(params):
        sampler.bind(slot, p.seed, p)
    slots = torch.arange(2)
    logits = torch.randn(2 * length, vocab, generator=torch.Generator().manual_seed(0))
    flags = torch.ones(2, dtype=torch.bool)
    _, _, rows = sampler.canvas_inputs(slots, flags)
    reqs = [request(p, canvas_length=length) for p in params]
    filtered = logits.clone()
    process_rows_(filtered, length, reqs, slots, sampler.state.knobs, sampler.state.bias_ids)
    new, _ = sampler.denoise(filtered, rows)
    assert torch.equal(new.canvas[0], new.draft[0])
    assert torch.equal(new.draft[0], logits[:length].argmax(-1))
    assert not torch.equal(new.canvas[1], new.draft[1])
    assert torch.equal(filtered[length:], logits[length:])  # the other row is untouched


def test_out_of_range_filters_are_refused_by_name() -> None:
    for field, value in (("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("top_k", -2)):
        with pytest.raises(ParamError, match=field):
            SamplingParams(**{field: value})  # type: ignore[arg-type]
