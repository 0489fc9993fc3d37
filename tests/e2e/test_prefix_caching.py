"""Prefix caching end to end on a tiny model whose sliding window (8) is shorter than every
reused prefix, so every hit relies on the window pages it takes over: what a request gets with
caching on is what it gets with caching off, whatever was cached before it."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams

PAGE = 16  # EngineConfig's default page size
SEEDS = range(20)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Path:
    return tiny_checkpoint("c32-window")


@pytest.fixture(scope="module")
def cached(checkpoint: Path) -> LLM:
    return LLM.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def uncached(checkpoint: Path) -> LLM:
    return LLM.from_pretrained(checkpoint, config=EngineConfig(prefix_caching=False))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 250) for _ in range(n)]


def _cases(seed: int) -> tuple[list[int], dict[str, tuple[list[int], int]]]:
    """A seed's primed prompt, and its probes: {case: (prompt, tokens expected cached)}."""
    rng = random.Random(seed)
    primed = _tokens(rng, 50)
    return (
        primed,
        {
            "cold": (_tokens(rng, 45), 0),
            "warm": (primed, 48),  # all full pages but the one holding the last position
            "partial": (primed[:32] + _tokens(rng, 13), 32),
            "mid-page": (primed[:40] + _tokens(rng, 9), 32),  # the shared part ends mid-page
            "longer": (primed + _tokens(rng, 20), 48),  # a longer prompt reusing the whole primed
        },
    )


def test_every_case_gives_the_tokens_of_caching_off_for_20_seeds(cached: LLM, uncached: LLM):
    """AR tokens (sampled, per seed) with caching on equal those with caching off, and each
    case found exactly the pages it should have."""
    params = [SamplingParams(mode=DecodeMode.AR, max_tokens=2, seed=s) for s in SEEDS]
    cached.generate([_cases(s)[0] for s in SEEDS], params)  # prime
    probes = [(s, case, *probe) for s in SEEDS for case, probe in _cases(s)[1].items()]
    probe_params = [p for p in params for _ in range(5)]
    on = cached.generate([p for _, _, p, _ in probes], probe_params)
    off = uncached.generate([p for _, _, p, _ in probes], probe_params)
    assert [o.num_cached_tokens for o in on] == [n for *_, n in probes]
    mismatched = [
        (s, c)
        for (s, c, *_), a, b in zip(probes, on, off, strict=True)
        if a.output_ids != b.output_ids
    ]
    assert not mismatched
    assert all(o.num_cached_tokens == 0 for o in off)


def test_choices_of_one_prompt_submitted_together_compute_it_once(cached: LLM):
    prompt = _tokens(random.Random(55), 40)
    params = [SamplingParams(mode=DecodeMode.AR, max_tokens=2, seed=i) for i in range(3)]
    outs = cached.generate([prompt] * 3, params)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]


@contextmanager
def _first_denoise_logits(llm: LLM) -> Iterator[list[torch.Tensor]]:
    """Collects the denoise logits of every forward that has any."""
    captured: list[torch.Tensor] = []
    runner = llm.engine.runner
    original = runner.execute

    def execute(step: Any) -> Any:
        out = original(step)
        if out.denoise_logits is not None:
            captured.append(out.denoise_logits.clone())
        return out

    runner.execute = execute  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        del runner.execute


def test_a_canvas_over_a_cached_prefix_sees_the_logits_of_recomputing_it(cached, uncached):
    """Diffusion: the first denoising step over each case's prompt, alone, is within fast
    numerics' tolerance of caching off (a missing or misplaced window would be off by O(1))."""
    params = SamplingParams(mode=DecodeMode.DIFFUSION, max_tokens=8, max_denoising_steps=1, seed=3)
    primed, probes = _cases(100)
    cached.generate(primed, params)
    for case, (prompt, expected) in probes.items():
        with _first_denoise_logits(cached) as on, _first_denoise_logits(uncached) as off:
            (out,) = cached.generate(prompt, params)
            uncached.generate(prompt, params)
        assert out.num_cached_tokens == expected, case
        error = (on[0] - off[0]).abs().max() / off[0].abs().max()
        assert error <= 1e-4, (case, error.item())


def test_many_distinct_prefixes_under_a_small_kv_budget_evict_without_error_or_leak(
    checkpoint: Path, uncached: LLM
):
    """16 full pages, 24 prompts of 3 pages each: idle pages are taken back, least recently
    released first; every output equals caching off; nothing is held at the end."""
    small = LLM.from_pretrained(checkpoint, config=EngineConfig(kv_cache_tokens=16 * PAGE))
    rng = random.Random(7)
    prompts = [_tokens(rng, 40) for _ in range(12)]
    prompts += [p[:33] + _tokens(rng, 7) for p in prompts]  # each shares 2 pages with one above
    params = [SamplingParams(mode=DecodeMode.AR, max_tokens=3, seed=i) for i in range(24)]
    on = [small.generate(prompts[i : i + 4], params[i : i + 4]) for i in range(0, 24, 4)]
    off = uncached.generate(prompts, params)
    assert [o.output_ids for batch in on for o in batch] == [o.output_ids for o in off]
    sched = small.engine.scheduler
    sched.check()
    assert small.engine.pages.usage() == 0.0 and not sched.requests
    assert sched.num_cached_tokens < 12 * 32  # the budget could not keep every shared page


def test_exact_numerics_never_reuse_a_prefix(checkpoint: Path):
    exact = LLM.from_pretrained(checkpoint, exact=True)
    assert exact.engine.pages.cache is None and not exact.engine.limits.prefix_caching
    prompt = list(range(5, 45))
    params = SamplingParams(mode=DecodeMode.AR, max_tokens=2, seed=1)
    first, again = exact.generate([prompt, prompt], [params, params])
    assert again.num_cached_tokens == 0 and again.output_ids == first.output_ids
