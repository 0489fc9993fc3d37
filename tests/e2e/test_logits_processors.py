"""The logits processors (`engine.logits`): min_p, logit_bias and the repetition, frequency and
presence penalties, each by its effect, in both decoding modes and both numerics; exact
numerics as the reference's processors, fast numerics as exact's."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import LLM, DecodeMode, SamplingParams
from engine.logits import filters
from engine.logits.batched import process_rows_, runs
from engine.logits.filters import top_p_floor
from engine.logits.processors import process_, processing
from tests.e2e.filter_cases import PerPosition, filter_logits, request
from tests.e2e.parity_cases import expected_prefix, prompts_for, reference_generate
from tests.e2e.sampler_cases import make_sampler

MODES = [DecodeMode.DIFFUSION, DecodeMode.AR, DecodeMode.HYBRID]
NUMERICS = pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])


@pytest.fixture(scope="module")
def llms(tiny_checkpoint):
    """llms(exact) -> an LLM over the c16 checkpoint (one per numerics, shared by the tests)."""
    loaded: dict[bool, LLM] = {}

    def get(exact: bool) -> LLM:
        if exact not in loaded:
            loaded[exact] = LLM.from_pretrained(tiny_checkpoint("c16"), exact=exact)
        return loaded[exact]

    return get


def logits_of(rows: int, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("k,p,m", [(0, 1.0, 0.1), (0, 1.0, 1.0), (7, 0.8, 0.05), (0, 0.9, 0.3)])
def test_min_p_is_the_references_warper_bit_for_bit(k: int, p: float, m: float) -> None:
    x, n = logits_of(33, seed=k), 33
    want = x
    for used, warper in ((k, TopKLogitsWarper(k or 1)), (p < 1, TopPLogitsWarper(p))):
        want = warper(None, want) if used else want
    want = MinPLogitsWarper(m)(None, want)
    floor = torch.full((n,), top_p_floor(p), dtype=torch.float32)
    got = filter_logits(x, torch.full((n,), k), floor, k, p < 1, torch.full((n,), m))
    assert torch.equal(got, want)
    if m == 1.0:  # only the most likely token is left
        assert torch.equal(torch.isfinite(got).sum(-1), torch.ones(n, dtype=torch.long))


def test_filters_work_in_place_a_chunk_at_a_time(monkeypatch) -> None:
    x, n = logits_of(10, seed=2), 10
    args = (torch.full((n,), 5), torch.full((n,), top_p_floor(0.7)), torch.full((n,), 0.2))
    whole = filter_logits(x, args[0], args[1], 5, True, args[2])
    monkeypatch.setattr(filters, "FILTER_CHUNK_ELEMENTS", 3 * x.shape[1])  # 3 positions
    y = x.clone()
    pointer = y.data_ptr()
    filters.filter_logits_(y, *args[:2], args[2], 5, True, True)
    assert y.data_ptr() == pointer and torch.equal(y, whole)


def test_exact_processors_are_the_references_bit_for_bit() -> None:
    prompt, output = [3, 9, 9, 41], [41, 7, 250]
    x = logits_of(16, seed=4)
    req = request(
        prompt=prompt,
        output=output,
        logit_bias={"7": 2.5, 100: -1.25},
        repetition_penalty=1.7,
        top_k=40,
        top_p=0.95,
        min_p=0.02,
    )
    ids = torch.tensor([prompt + output])
    reference = LogitsProcessorList(
        [
            SequenceBiasLogitsProcessor({(7,): 2.5, (100,): -1.25}),
            RepetitionPenaltyLogitsProcessor(1.7),
            TopKLogitsWarper(40),
            TopPLogitsWarper(0.95),
            MinPLogitsWarper(0.02),
        ]
    )
    want = PerPosition(reference)(ids, x[None])[0]
    got = x.clone()
    process_(got, req)
    assert torch.equal(got, want)


def test_frequency_and_presence_penalties_count_the_committed_tokens_only() -> None:
    x = logits_of(4, seed=5)
    req = request(prompt=[1, 2], output=[2, 5, 5], frequency_penalty=0.5, presence_penalty=1.5)
    got = x.clone()
    process_(got, req)
    want = x.clone()
    want[:, 2] -= 0.5 * 1 + 1.5
    want[:, 5] -= 0.5 * 2 + 1.5  # token 1: in the prompt only, not penalised
    assert torch.allclose(got, want) and torch.equal(got[:, [0, 1, 3]], x[:, [0, 1, 3]])


def test_neutral_processors_change_no_bit() -> None:
    x = logits_of(8, seed=6)
    req = request(prompt=[1, 2, 3], output=[4, 4], logit_bias={}, repetition_penalty=1.0)
    got = x.clone()
    process_(got, req)
    assert torch.equal(got, x)


def test_fast_processing_equals_exact_and_leaves_other_rows_alone() -> None:
    length, vocab = 4, 300
    sampler = make_sampler(4, length, vocab, hidden=8)
    settings = [
        dict(top_k=3, min_p=0.1),
        {},
        dict(logit_bias={"9": 3.0, "12": -4.0}, frequency_penalty=1.0, presence_penalty=-0.5),
        dict(repetition_penalty=1.3, top_p=0.8),
    ]
    reqs = [request(prompt=[9, 3], output=[12, 12], canvas_length=length, **s) for s in settings]
    slots = torch.tensor([2, 0, 3, 1])
    for req, slot in zip(reqs, slots.tolist(), strict=True):
        sampler.bind(slot, 0, req.params)
    x = logits_of(4 * length, vocab, seed=7)
    fast = x.clone()
    process_rows_(fast, length, reqs, slots, sampler.state.knobs, sampler.state.bias_ids)
    for r, req in enumerate(reqs):
        exact = x[r * length : (r + 1) * length].clone()
        process_(exact, req)
        assert torch.equal(fast[r * length : (r + 1) * length], exact), r
    assert torch.equal(fast[length : 2 * length], x[length : 2 * length])


def test_rows_whose_raw_logits_are_read_later_are_restored() -> None:
    x = logits_of(6, seed=8)
    reqs = [request(top_k=2, logprobs=1), request(top_k=2)]
    y = x.clone()
    with processing(y, 3, reqs) as rows:
        assert rows == [0, 1]
        for r, req in enumerate(reqs):
            process_(y[r * 3 : (r + 1) * 3], req)
        assert not torch.equal(y[:3], x[:3])  # processed while sampling
    assert torch.equal(y[:3], x[:3]) and not torch.equal(y[3:], x[3:])


def test_runs_are_the_maximal_consecutive_stretches() -> None:
    assert list(runs([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 6), (7, 9)]
    assert list(runs([])) == []


@NUMERICS
@pytest.mark.parametrize("mode", MODES)
def test_a_large_logit_bias_forces_a_token_and_a_negative_one_bans_it(llms, exact, mode) -> None:
    llm = llms(exact)
    base = dict(max_tokens=20, seed=1, mode=mode, temperature=1.0, max_denoising_steps=3)
    prompt = [5, 6, 7, 8]
    forced = SamplingParams(**base, logit_bias={"77": 100}, ignore_eos=True)  # type: ignore[arg-type]
    assert llm.generate(prompt, forced)[0].output_ids == [77] * 20
    free = llm.generate(prompt, SamplingParams(**base))[0].output_ids  # type: ignore[arg-type]
    banned = {str(t): -100 for t in free}
    out = llm.generate(prompt, SamplingParams(**base, logit_bias=banned))[0].output_ids  # type: ignore[arg-type]
    assert out and not set(out) & set(free)


@NUMERICS
@pytest.mark.parametrize("mode", [DecodeMode.DIFFUSION, DecodeMode.AR])
def test_log_probabilities_stay_those_of_the_raw_logits(llms, exact, mode) -> None:
    base = dict(max_tokens=4, seed=1, mode=mode, max_denoising_steps=2, logprobs=0)
    params = SamplingParams(**base, logit_bias={"77": 100}, ignore_eos=True)  # type: ignore[arg-type]
    (out,) = llms(exact).generate([5, 6, 7, 8], params)
    assert out.output_ids == [77] * 4 and out.logprobs is not None
    # processed, 77 would be certain (log-probability ~0); the model alone finds it unlikely
    assert out.logprobs[0].logprob < -1


@NUMERICS
@pytest.mark.parametrize("mode", [DecodeMode.DIFFUSION, DecodeMode.AR])
def test_min_p_of_one_keeps_only_the_most_likely_token(llms, exact, mode) -> None:
    llm = llms(exact)
    base = dict(max_tokens=16, seed=2, mode=mode, temperature=1.0, max_denoising_steps=3)
    one = llm.generate([5, 6, 7], SamplingParams(**base, min_p=1.0))[0].output_ids  # type: ignore[arg-type]
    top1 = llm.generate([5, 6, 7], SamplingParams(**base, top_k=1))[0].output_ids  # type: ignore[arg-type]
    assert one == top1
    if mode is DecodeMode.AR:  # sampling from one candidate is greedy
        greedy = SamplingParams(**{**base, "temperature": 0.0})  # type: ignore[arg-type]
        assert one == llm.generate([5, 6, 7], greedy)[0].output_ids


# Two tokens lifted far above the rest: `A` more than `B` (by more than the model's own logits
# tell them apart), so without penalties the output is all A; the penalties, counted as the
# docs define them, decide between them.
A, B = 90, 91
LIFT = {str(A): 60.0, str(B): 50.0}


@NUMERICS
@pytest.mark.parametrize("mode", [DecodeMode.DIFFUSION, DecodeMode.AR])
def test_repetition_penalty_counts_the_prompt(llms, exact, mode) -> None:
    llm = llms(exact)
    base = dict(max_tokens=16, seed=3, mode=mode, max_denoising_steps=3, logit_bias=LIFT)
    prompt = [5, A, 7]
    free = llm.generate(prompt, SamplingParams(**base))[0].output_ids  # type: ignore[arg-type]
    assert free == [A] * 16
    # (x_A + 60) / 2 < x_B + 50: B until B, seen too, is penalised as much
    out = llm.generate(prompt, SamplingParams(**base, repetition_penalty=2.0))[0].output_ids  # type: ignore[arg-type]
    assert out[0] == B and A not in out[: 16 if mode is DecodeMode.DIFFUSION else 1]


@NUMERICS
def test_frequency_penalty_acts_per_token_in_ar_and_per_canvas_in_diffusion(llms, exact) -> None:
    llm = llms(exact)
    base = dict(max_tokens=32, seed=4, max_denoising_steps=3, logit_bias=LIFT)
    penalties = dict(frequency_penalty=2.0, presence_penalty=2.0)
    for mode in (DecodeMode.AR, DecodeMode.DIFFUSION):
        free = llm.generate([5, 6, 7], SamplingParams(**base, mode=mode))[0].output_ids  # type: ignore[arg-type]
        assert free == [A] * 32, mode
    ar = SamplingParams(**base, **penalties, mode=DecodeMode.AR)  # type: ignore[arg-type]
    out = llm.generate([5, 6, 7], ar)[0].output_ids
    # each A committed lowers A's next logits by 2 (and 2 for the first): B's turn comes
    assert set(out) == {A, B} and out[0] == A
    diffusion = SamplingParams(**base, **penalties, mode=DecodeMode.DIFFUSION)  # type: ignore[arg-type]
    out = llm.generate([5, 6, 7], diffusion)[0].output_ids
    # the first canvas sees no committed token: all A, though its own draft is all A; the
    # second sees the 16 A's (60 - 34 < 50)
    assert out == [A] * 16 + [B] * 16


def test_exact_diffusion_matches_the_reference_with_its_processors(
    tiny_checkpoint, reference_model, llms
) -> None:
    ref, llm = reference_model(tiny_checkpoint("c16")), llms(True)
    eos = set(llm.defaults.eos_token_ids)
    for seed, prompt in enumerate(prompts_for(llm)[1:2]):
        token = prompt[0]
        processors = [
            PerPosition(SequenceBiasLogitsProcessor({(token,): 1.5})),
            PerPosition(RepetitionPenaltyLogitsProcessor(1.8)),
            PerPosition(MinPLogitsWarper(0.05)),
        ]
        ref_ids, _ = reference_generate(
            ref,
            prompt,
            seed,
            max_new_tokens=32,
            max_denoising_steps=8,
            logits_processor=LogitsProcessorList(processors),
        )
        params = SamplingParams(
            max_tokens=32,
            seed=seed,
            max_denoising_steps=8,
            logit_bias={token: 1.5},
            repetition_penalty=1.8,
            min_p=0.05,
        )
        (out,) = llm.generate(prompt, params)
        assert out.output_ids == expected_prefix(ref_ids, eos, 32), seed


def test_penalty_counts_follow_the_committed_tokens_without_recounting_them():
    """The counts kept on a request equal a count from scratch after each commit, and the same
    tensors serve the steps between commits."""
    from types import SimpleNamespace

    from engine.logits.processors import token_counts

    cpu = torch.device("cpu")
    req = SimpleNamespace(prompt_ids=[5, 1, 5], output_ids=[], penalty_tokens=None)
    first = token_counts(req, cpu)  # type: ignore[arg-type]
    assert first.seen.tolist() == [1, 5] and first.generated.numel() == 0
    assert token_counts(req, cpu) is first  # type: ignore[arg-type]  # nothing committed since
    for tokens in ([7, 5, 7], [2], [7]):
        req.output_ids += tokens
        got = token_counts(req, cpu)  # type: ignore[arg-type]
        counted = {t: req.output_ids.count(t) for t in set(req.output_ids)}
        assert got.seen.tolist() == sorted({*req.prompt_ids, *req.output_ids})
        assert dict(zip(got.generated.tolist(), got.counts.tolist(), strict=True)) == counted
