"""Hybrid mode end to end on tiny checkpoints: canvases drafted by diffusion, verified by the
encoder. Greedy hybrid is AR greedy token for token in exact numerics (alone and in mixed
batches), whatever the drafts; rejected positions are rolled back without leaks; budgets, EOS,
grammars and log-probabilities behave as in AR mode."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from engine.draft_policy import DraftPolicy, StepCost
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams
from engine.rows import ROW_KINDS
from engine.scheduler import SchedulerConfig
from engine.types import RowKind

SEEDS = range(20)
MAX_TOKENS = 12
DRAFT_STEPS = 1  # the drafter is not under test (and random weights draft noise)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(1 + seed % 7)]


def _params(mode: DecodeMode, seed: int, **kw: object) -> SamplingParams:
    kw = {"max_tokens": MAX_TOKENS, **kw}
    if mode is not DecodeMode.AR:
        kw.setdefault("max_denoising_steps", DRAFT_STEPS)
    return SamplingParams(mode=mode, seed=seed, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def exact_llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    return LLM.from_pretrained(tiny_checkpoint("c16"), exact=True)


@pytest.fixture(scope="module")
def fast_llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    """Fast numerics, drafting per request (random weights never earn drafts under the
    adaptive policy, and these tests are about what drafts do)."""
    config = EngineConfig(scheduler=SchedulerConfig(draft_policy=DraftPolicy(adaptive=False)))
    return LLM.from_pretrained(tiny_checkpoint("c16"), config=config)


@pytest.fixture(scope="module")
def ar_outputs(exact_llm: LLM) -> dict[int, list[int]]:
    outs = exact_llm.generate(
        [_prompt(s) for s in SEEDS], [_params(DecodeMode.AR, s) for s in SEEDS]
    )
    return {s: o.output_ids for s, o in zip(SEEDS, outs, strict=True)}


def _oracle_drafts(
    monkeypatch: pytest.MonkeyPatch, truth: dict[tuple[int, ...], list[int]]
) -> None:
    """Replace hybrid drafts by AR's own continuation, corrupted from a random position on, so
    that verify passes accept long prefixes, reject mid-canvas and accept whole canvases (a
    random-weight drafter is almost never right)."""
    kind = ROW_KINDS[RowKind.DENOISE]
    original = kind.effect
    rng = random.Random(0)

    def effect(row, result):  # type: ignore[no-untyped-def]
        out = original(row, result)
        req = row.req
        commit = out.progress.draft_to_commit
        if commit and out.progress.state == RowKind.VERIFY:
            done = len(req.output_ids)  # the pending token is output index done - 1
            future = truth[tuple(req.prompt_ids)][done - 1 :]
            draft = (future + commit)[: len(commit)]
            wrong_from = rng.choice([1, 2, len(draft) // 2, len(draft)])
            for i in range(wrong_from, len(draft)):
                draft[i] = (draft[i] + 1) % 256
            out = replace(out, progress=replace(out.progress, draft_to_commit=draft))
        return out

    monkeypatch.setattr(kind, "effect", effect)


def test_greedy_hybrid_equals_ar_over_20_seeds_alone_and_batched(
    exact_llm, ar_outputs, monkeypatch
):
    _oracle_drafts(monkeypatch, {tuple(_prompt(s)): ar_outputs[s] for s in SEEDS})
    params = [_params(DecodeMode.HYBRID, s) for s in SEEDS]
    batched = exact_llm.generate([_prompt(s) for s in SEEDS], params)
    for seed, out in zip(SEEDS, batched, strict=True):
        assert out.output_ids == ar_outputs[seed], seed
        (alone,) = exact_llm.generate(_prompt(seed), params[seed])
        assert alone.output_ids == ar_outputs[seed], seed
    # drafts were accepted: far fewer verify passes than tokens
    assert sum(o.encoder_passes for o in batched) < sum(len(o.output_ids) for o in batched) / 2


def test_mixed_batch_of_ar_diffusion_and_hybrid_rows_with_the_real_drafter(exact_llm, ar_outputs):
    seeds = list(SEEDS)[:6]
    modes = [DecodeMode.AR, DecodeMode.DIFFUSION, DecodeMode.HYBRID] * 2
    params = [_params(m, s) for m, s in zip(modes, seeds, strict=True)]
    mixed = exact_llm.generate([_prompt(s) for s in seeds], params)
    for seed, mode, p, out in zip(seeds, modes, params, mixed, strict=True):
        if mode is DecodeMode.DIFFUSION:
            (alone,) = exact_llm.generate(_prompt(seed), p)
            assert out.output_ids == alone.output_ids
        else:
            assert out.output_ids == ar_outputs[seed], (seed, mode)


def test_sampled_hybrid_is_seeded_and_batch_invariant(exact_llm):
    params = [_params(DecodeMode.HYBRID, s, temperature=2.0) for s in range(3)]
    prompts = [_prompt(4)] * 3
    batch = exact_llm.generate(prompts, params)
    alone = [exact_llm.generate(p, q)[0] for p, q in zip(prompts, params, strict=True)]
    assert [o.output_ids for o in batch] == [o.output_ids for o in alone]
    assert len({tuple(o.output_ids) for o in batch}) > 1  # the seeds matter


def test_fast_greedy_hybrid_matches_ar(fast_llm):
    llm = fast_llm
    prompts = [_prompt(s) for s in range(4)]
    ar = llm.generate(prompts, [_params(DecodeMode.AR, s) for s in range(4)])
    hybrid = llm.generate(prompts, [_params(DecodeMode.HYBRID, s) for s in range(4)])
    assert [o.output_ids for o in hybrid] == [o.output_ids for o in ar]


def test_max_tokens_and_eos_cut_exactly_as_in_ar(exact_llm, ar_outputs, monkeypatch):
    _oracle_drafts(monkeypatch, {tuple(_prompt(s)): ar_outputs[s] for s in SEEDS})
    for budget in (1, 2, 7):
        (out,) = exact_llm.generate(_prompt(3), _params(DecodeMode.HYBRID, 3, max_tokens=budget))
        assert out.output_ids == ar_outputs[3][:budget] and out.finish_reason == "length"
    eos = ar_outputs[5][6]
    cut = exact_llm.generate(_prompt(5), _params(DecodeMode.HYBRID, 5, eos_token_ids=(eos,)))[0]
    ar = exact_llm.generate(_prompt(5), _params(DecodeMode.AR, 5, eos_token_ids=(eos,)))[0]
    assert cut.output_ids == ar.output_ids and cut.finish_reason == ar.finish_reason == "stop"


def test_logprobs_are_the_verifiers_and_equal_ars(exact_llm, ar_outputs, monkeypatch):
    _oracle_drafts(monkeypatch, {tuple(_prompt(s)): ar_outputs[s] for s in SEEDS})
    hybrid = exact_llm.generate(_prompt(2), _params(DecodeMode.HYBRID, 2, logprobs=2))[0]
    ar = exact_llm.generate(_prompt(2), _params(DecodeMode.AR, 2, logprobs=2))[0]
    assert hybrid.logprobs == ar.logprobs and len(ar.logprobs or []) == MAX_TOKENS


def test_structured_output_is_valid_over_20_seeds(fast_llm):
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer"}},
        "required": ["kind", "age"],
    }
    params = [
        SamplingParams(
            mode=DecodeMode.HYBRID, seed=s, temperature=1.0, max_tokens=40,
            json_schema=json.dumps(schema), max_denoising_steps=DRAFT_STEPS,
        )
        for s in SEEDS
    ]  # fmt: skip
    outs = fast_llm.generate([[5, 6, 7]] * len(params), params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_a_thousand_hybrid_requests_leak_nothing(fast_llm):
    """Rejected positions are rolled back (not advancing the computed length); every request
    releases its pages and sampler slot (the engine's `check` runs after every step)."""
    llm = fast_llm
    engine = llm.engine
    params = [
        SamplingParams(
            mode=DecodeMode.HYBRID,
            seed=i,
            max_tokens=1 + i % 3,
            temperature=i % 2,
            max_denoising_steps=DRAFT_STEPS,
        )
        for i in range(1000)
    ]
    prompts = [_prompt(i % 50) for i in range(1000)]
    for start in range(0, 1000, 500):
        outs = llm.generate(prompts[start : start + 500], params[start : start + 500])
        assert all(o.finish_reason in ("length", "stop") for o in outs)
    engine.scheduler.check()
    full_unheld, _ = engine.pages.num_unheld()
    assert not engine.requests and full_unheld == engine.pages.full.num_pages


def test_verify_passes_show_their_draft_and_verdict_to_a_client_that_asks(
    exact_llm, ar_outputs, monkeypatch
):
    """With `want_drafts`, each verify pass's output names the proposals it saw and how many it
    accepted: the tokens it commits are those accepted proposals, then the verifier's own."""
    _oracle_drafts(monkeypatch, {tuple(_prompt(s)): ar_outputs[s] for s in SEEDS})
    engine, seed = exact_llm.engine, 3
    params = exact_llm.validator.validate(_prompt(seed), _params(DecodeMode.HYBRID, seed))
    engine.add_request("shown", _prompt(seed), params, want_drafts=True)
    verdicts, tokens, finished = [], [], False
    while not finished:
        for out in engine.step().outputs:
            tokens += out.new_token_ids
            finished = out.finish_reason is not None
            if out.verified is not None:
                verdicts.append((out.verified, out.accepted, out.new_token_ids))
    assert tokens == ar_outputs[seed]
    assert verdicts and any(0 < a < len(v) for v, a, _ in verdicts)  # some partly accepted
    for verified, accepted, new in verdicts:
        assert len(verified) == engine.canvas_length - 1 and 0 <= accepted <= len(verified)
        assert new[:accepted] == verified[:accepted]  # the accepted proposals are committed
        if len(new) > accepted < len(verified):  # then the verifier's token replaced one
            assert new[accepted] != verified[accepted]
    # without want_drafts nothing is shown
    engine.add_request("hidden", _prompt(seed), params)
    while engine.has_work():
        assert all(out.verified is None for out in engine.step().outputs)


def test_the_adaptive_policy_stops_drafting_where_drafts_cannot_pay(tiny_checkpoint, monkeypatch):
    """Fast numerics learn from the engine's steps what a canvas pass costs: where even a
    canvas accepted whole would not pay (compute-bound: step time all per token), hybrid
    requests take AR steps from the start (AR's text); where drafts are cheap they draft, and
    once verify passes show nothing accepted, new requests start in AR and only probe."""
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    scheduler = llm.engine.scheduler
    assert scheduler.load_aware
    prompts = [_prompt(s) for s in range(6)]
    params = [_params(DecodeMode.HYBRID, s) for s in range(6)]
    ar = llm.generate(prompts, [_params(DecodeMode.AR, s) for s in range(6)])

    def cost(fixed: float) -> StepCost:
        model = StepCost()
        for tokens in (1, 16) * 8:
            model.observe(tokens, fixed + 0.001 * tokens)
        monkeypatch.setattr(model, "observe", lambda *a: None)  # keep the synthetic fit
        return model

    scheduler.step_cost = cost(fixed=0.0)  # a canvas pass costs 16 AR passes
    compute_bound = llm.generate(prompts, params)
    assert [o.output_ids for o in compute_bound] == [o.output_ids for o in ar]
    assert all(o.verify_passes == 0 and o.decoder_passes == 0 for o in compute_bound)
    scheduler.step_cost = cost(fixed=1.0)  # a canvas pass costs about one AR pass
    first = llm.generate(prompts[:1], params[:1])[0]
    assert first.verify_passes >= 1  # no acceptance known yet: it drafts
    assert scheduler.accept_prior is not None and scheduler.accept_prior < 1  # random drafts
    later = llm.generate(prompts[1:], params[1:])
    assert all(o.verify_passes == 0 for o in later)  # MAX_TOKENS < a probe's distance
    assert [o.output_ids for o in later] == [o.output_ids for o in ar[1:]]
