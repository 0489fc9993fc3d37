"""Fault injection: a fault at any stage of the step, in one request's row of a mixed batch (AR
and diffusion, constrained and free, log-probabilities and drafts or not), fails only that
request, leaks no page or sampler slot, and leaves the engine serving the next 100 requests —
in both numerics. Then every numeric parameter at its extremes, followed by a burst of 16."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import postprocess as postprocess_module
from engine import rows as rows_module
from engine import scheduler as scheduler_module
from engine.draft_policy import DraftPolicy
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, ParamError, SamplingParams
from engine.rows import ROW_KINDS
from engine.scheduler import SchedulerConfig
from engine.types import FinishReason, RowKind

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
# The mixed batch: (name, parameters, wants drafts). Prompt lengths differ, so each request's
# context is unique and an injection can recognise its victim by it.
MIX: list[tuple[str, dict[str, Any], bool]] = [
    ("diffusion", {"mode": DecodeMode.DIFFUSION}, False),
    ("diffusion-json", {"mode": DecodeMode.DIFFUSION, "json_schema": SCHEMA}, False),
    ("ar", {"mode": DecodeMode.AR}, False),
    ("ar-json", {"mode": DecodeMode.AR, "json_schema": SCHEMA}, False),
    ("diffusion-logprobs-drafts", {"mode": DecodeMode.DIFFUSION, "logprobs": 2}, True),
    ("ar-logprobs-sampled", {"mode": DecodeMode.AR, "logprobs": 2, "temperature": 0.7}, False),
    ("hybrid", {"mode": DecodeMode.HYBRID}, False),  # drafts, then VERIFY rows
]


class Injected(RuntimeError):
    """The fault the tests inject."""


def _params(i: int, extra: dict[str, Any], max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=i, max_denoising_steps=3, **extra)


@pytest.fixture(scope="module", params=[False, True], ids=["fast", "exact"])
def llm(request: pytest.FixtureRequest, tiny_checkpoint: Callable[[str], Path]) -> LLM:
    # The hybrid victim must draft (its verify stage is a target): a per-request draft policy,
    # not one that learns from the other requests that drafts of random weights do not pay.
    config = EngineConfig(scheduler=SchedulerConfig(draft_policy=DraftPolicy(adaptive=False)))
    return LLM.from_pretrained(tiny_checkpoint("c16"), exact=request.param, config=config)


def _prompt(i: int) -> list[int]:
    return [5 + (i * 7 + k) % 200 for k in range(3 + 2 * i)]


def _run(
    llm: LLM, start: int, count: int, max_tokens: int = 20
) -> dict[str, tuple[list[int], FinishReason, str | None]]:
    """Requests start..start+count of the mix, all at once, each with a budget of max_tokens;
    {id: (tokens, reason, error)}."""
    eng, results = llm.engine, {}
    tokens: dict[str, list[int]] = {}
    for i in range(start, start + count):
        name, extra, drafts = MIX[i % len(MIX)]
        params = llm.validator.validate(_prompt(i % 40), _params(i, extra, max_tokens))
        eng.add_request(f"{name}-{i}", _prompt(i % 40), params, want_drafts=drafts)
        tokens[f"{name}-{i}"] = []
    while eng.has_work():
        for out in eng.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                results[out.request_id] = (tokens[out.request_id], out.finish_reason, out.error)
    assert set(results) == set(tokens)
    return results


def _assert_nothing_held(llm: LLM) -> None:
    sched = llm.engine.scheduler
    sched.check()
    assert not sched.requests and sched.slots.num_free == sched.config.max_num_seqs
    assert llm.engine.pages.usage() == 0.0


# -- the injections: each raises (or poisons a value) only for the victim's row ----------------


def _pages(req: Any) -> Any:
    return req.pages if req is not None else object()  # a victim gone holds nothing


def _victim_reqs(reqs: list[Any], victim: str) -> bool:
    return any(r.request_id == victim for r in reqs)


@contextmanager
def inject(llm: LLM, stage: str, victim: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    eng = llm.engine
    req = lambda: eng.requests.get(victim)  # noqa: E731 - looked up when the fault fires

    def wrap(
        obj: Any, name: str, fire: Callable[..., bool], poison: Callable[..., Any] | None = None
    ) -> None:
        original = getattr(obj, name)

        def faulty(*args: Any, **kwargs: Any) -> Any:
            if fire(*args, **kwargs):
                if poison is None:
                    raise Injected(f"{stage} fault")
                args = poison(*args)
            return original(*args, **kwargs)

        monkeypatch.setattr(obj, name, faulty)

    if stage == "schedule":
        wrap(eng.scheduler, "row_for", lambda seq, *a: seq.request_id == victim)
    elif stage == "admission":
        context = lambda: req().context if req() else -1  # noqa: E731
        wrap(eng.pages, "allocate", lambda ctx, *_: ctx == context())
    elif stage == "inputs":
        wrap(eng.sampling, "canvas_inputs", lambda reqs, _: _victim_reqs(reqs, victim))
        for kind in (RowKind.PREFILL, RowKind.AR, RowKind.COMMIT, RowKind.VERIFY):
            wrap(ROW_KINDS[kind], "encode_input", lambda row: row.seq_id == victim)
    elif stage == "forward":
        held = lambda step: [*step.denoise_pages, *(e.pages for e in step.encode)]  # noqa: E731
        wrap(eng.runner, "execute", lambda step: any(p is _pages(req()) for p in held(step)))
    elif stage == "forward-nan":  # the victim's logits only: the sampler must find them
        original = eng.runner.execute

        def nan_logits(step: Any) -> Any:
            out = original(step)
            pages, length = _pages(req()), eng.canvas_length
            with torch.inference_mode():
                for j, held in enumerate(step.denoise_pages):
                    if held is pages:
                        out.denoise_logits[j * length : (j + 1) * length] = float("nan")
                last = [e for e in step.encode if e.wants_last_logits]
                for k, e in enumerate(last):
                    if e.pages is pages:
                        out.last_logits[k] = float("nan")
            return out

        monkeypatch.setattr(eng.runner, "execute", nan_logits)
    elif stage == "sampler":
        wrap(eng.sampling, "sample_canvases", lambda _c, _l, reqs: _victim_reqs(reqs, victim))
        wrap(eng.sampling, "sample_tokens", lambda _l, reqs: _victim_reqs(reqs, victim))
    elif stage == "grammar":

        def fork_raises() -> None:
            raise Injected("grammar fault")

        monkeypatch.setattr(req().constraint, "fork", fork_raises)
    elif stage == "verify":  # judging the victim's hybrid draft (its VERIFY row) raises
        wrap(rows_module, "verify_draft", lambda seq, *a: seq.request_id == victim)
    elif stage == "post-process":  # only the victim asks for log-probabilities
        wrap(postprocess_module, "token_logprobs", lambda *a: True)
    elif stage == "output":  # building the victim's final output
        original_stats = scheduler_module.request_stats

        def stats(seq: Any, now: float) -> Any:
            if seq.request_id == victim:
                raise Injected("output fault")
            return original_stats(seq, now)

        monkeypatch.setattr(scheduler_module, "request_stats", stats)
    yield


STAGES = {
    # stage: the mix entries whose row it can hit
    "schedule": range(len(MIX)),
    "admission": range(len(MIX)),
    "inputs": range(len(MIX)),
    "forward": range(len(MIX)),
    "forward-nan": range(len(MIX)),
    "sampler": range(len(MIX)),
    "grammar": [1, 3],
    "post-process": [4, 5],
    "verify": [6],
    "output": range(len(MIX)),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_in_one_row_fails_only_its_request_and_leaks_nothing(
    llm: LLM, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    choice = random.Random(stage).choice(list(STAGES[stage]))
    eng = llm.engine
    names = {}
    for i in range(len(MIX)):
        name, extra, drafts = MIX[i]
        if stage == "post-process" and i != choice:
            extra = {k: v for k, v in extra.items() if k != "logprobs"}
        params = llm.validator.validate(_prompt(i), _params(i, extra))
        names[i] = f"{name}-{i}"
        eng.add_request(names[i], _prompt(i), params, want_drafts=drafts)
    victim = names[choice]
    results: dict[str, tuple[FinishReason, str | None]] = {}
    with monkeypatch.context() as patch, inject(llm, stage, victim, patch):
        while eng.has_work():
            for out in eng.step().outputs:
                if out.finish_reason is not None:
                    results[out.request_id] = (out.finish_reason, out.error)
    assert results.pop(victim)[1], f"{stage}: the victim did not fail"
    assert all(error is None for _, error in results.values()), results
    assert len(results) == len(MIX) - 1
    _assert_nothing_held(llm)
    after = _run(llm, 100, 100, max_tokens=8)  # one canvas each: the engine serves them all
    assert all(error is None and tokens for tokens, _, error in after.values())
    _assert_nothing_held(llm)


# -- parameter extremes ------------------------------------------------------------------------

HUGE = [0.0, 5e-324, 1e-30, 1e30, 1e308, float("inf"), float("-inf"), float("nan"), 2.0**63]
FLOAT_FIELDS = ["entropy_bound", "t_min", "t_max", "confidence_threshold", "temperature"]
INT_FIELDS = ["max_tokens", "seed", "max_denoising_steps", "stability_threshold", "logprobs"]
INTS = [0, 1, 2**31, 2**63 - 1, 2**63, -1]


def _extremes() -> Iterator[tuple[str, Any]]:
    for name in FLOAT_FIELDS:
        yield from ((name, v) for v in HUGE)
    for name in INT_FIELDS:
        yield from ((name, v) for v in INTS)


def test_every_numeric_parameter_at_its_extremes_is_refused_or_served(llm: LLM) -> None:
    """Each value is a ParamError naming its field, or runs to an ordinary end; then a burst
    of 16 ordinary requests all succeed and nothing is held."""
    served = 0
    for name, value in _extremes():
        for mode in (DecodeMode.DIFFUSION, DecodeMode.AR):
            base = {"max_tokens": 4, "max_denoising_steps": 2, "mode": mode}
            try:
                params = SamplingParams(**{**base, name: value})  # type: ignore[arg-type]
                out = llm.generate([5, 6, 7], params)[0]
            except ParamError as exc:
                assert exc.param in (name, "top_logprobs"), (name, value, exc)
                continue
            assert out.finish_reason in ("stop", "length"), (name, value)
            served += 1
    assert served > 20  # the representable values ran
    _assert_nothing_held(llm)
    burst = _run(llm, 0, 16)
    assert all(error is None and tokens for tokens, _, error in burst.values())
    _assert_nothing_held(llm)
