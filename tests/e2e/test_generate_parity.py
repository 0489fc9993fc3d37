"""End to end: Canvas' diffusion output equals the reference generate() for the same seed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

from engine import LLM, SamplingParams
from tests.conftest import ALL_PRESETS
from tests.e2e.parity_cases import expected_prefix, prompts_for, reference_generate

SEEDS = (0, 1, 2)
# On the real canvas length a reference generate() takes minutes on 2 cores, so there each
# prompt runs with one seed and the seeds take turns: every prompt and every seed still runs
# (5 generations instead of 15, the slowest test of the suite before); likewise on the
# sliding-window preset and on c16 (43 s of the suite with 15). The TPF test below reuses
# these runs.
ONE_SEED_PER_PROMPT = {"c256", "gqa8", "c32-window", "c16"}
# Presets whose random weights are confident enough for canvases to stop before the step cap
# (see engine.checkpoints.tiny): on these the adaptive stop must be exercised.
EARLY_STOP_PRESETS = {"c16", "c256"}


# The free-running reference generations of one preset, shared by the tests below.
ReferenceRun = Callable[[Path, list[int], int, int], tuple[list[int], float]]


@pytest.fixture(scope="module")
def reference_run(reference_model) -> ReferenceRun:
    """reference_run(path, prompt, seed, max_new_tokens) -> reference_generate's result, each
    run once per module. The reference emits whole canvases (ceil(max_new_tokens /
    canvas_length) of them, cut only by EOS), so two asks for the same number of canvases are
    the same run: it is keyed, and run, by that number."""
    done: dict[tuple[Path, tuple[int, ...], int, int], tuple[list[int], float]] = {}

    def get(path: Path, prompt: list[int], seed: int, max_new_tokens: int):
        ref = reference_model(path)
        length = ref.config.canvas_length
        num_canvases = -(-max_new_tokens // length)
        key = (path, tuple(prompt), seed, num_canvases)
        if key not in done:
            done[key] = reference_generate(ref, prompt, seed, max_new_tokens=num_canvases * length)
        return done[key]

    return get


def cases(prompts: list[list[int]], preset: str) -> list[tuple[list[int], int]]:
    """(prompt, seed) pairs: every prompt with every seed, or one seed per prompt in turn."""
    if preset in ONE_SEED_PER_PROMPT:
        return [(prompt, SEEDS[i % len(SEEDS)]) for i, prompt in enumerate(prompts)]
    return [(prompt, seed) for prompt in prompts for seed in SEEDS]


@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_diffusion_output_matches_reference_generate(preset, tiny_checkpoint, reference_run):
    path = tiny_checkpoint(preset)
    llm = LLM.from_pretrained(path, exact=True)
    length = llm.canvas_length
    max_tokens = length + length // 2 + 1  # not a multiple of the canvas length
    eos = set(llm.defaults.eos_token_ids)
    converged = 0
    for prompt, seed in cases(prompts_for(llm), preset):
        ref_ids, _ = reference_run(path, prompt, seed, max_tokens)
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=seed))
        want = expected_prefix(ref_ids, eos, max_tokens)
        assert out.output_ids == want, f"prompt len {len(prompt)}, seed {seed}"
        assert out.finish_reason == ("stop" if want[-1] in eos else "length")
        converged += sum(s < llm.defaults.max_denoising_steps for s in out.steps_per_canvas)
    if preset in EARLY_STOP_PRESETS:
        assert converged > 0, "no canvas stopped early: the adaptive stop was never exercised"


@pytest.mark.parametrize("preset", ["c16", "c32-window"])
def test_tokens_per_forward_matches_reference_when_nothing_is_cut(
    preset, tiny_checkpoint, reference_run
):
    path = tiny_checkpoint(preset)
    llm = LLM.from_pretrained(path, exact=True)
    max_tokens = 2 * llm.canvas_length
    checked = 0
    for prompt, seed in cases(prompts_for(llm), preset)[:9]:  # the parity test's runs
        ref_ids, ref_tpf = reference_run(path, prompt, seed, max_tokens)
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=seed))
        if out.finish_reason != "length" or llm.defaults.pad_token_id in ref_ids:
            continue  # an EOS cut (or a generated pad id, which the reference does not count)
        assert out.output_ids == ref_ids
        assert out.tokens_per_forward == pytest.approx(ref_tpf, rel=1e-6)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("preset", ["c16", "c32-window", "gqa8"])
def test_eos_in_the_middle_of_a_canvas_ends_the_output_there(
    preset, tiny_checkpoint, reference_model, reference_run
):
    path = tiny_checkpoint(preset)
    ref, llm = reference_model(path), LLM.from_pretrained(path, exact=True)
    # prompt 2 with seed 2 is one of the parity cases of every preset: its free run is shared
    length, max_tokens, seed = llm.canvas_length, 2 * llm.canvas_length, 2
    prompt = prompts_for(llm)[2]
    free_run, _ = reference_run(path, prompt, seed, max_tokens)
    # Use as EOS a token whose first occurrence is strictly inside the second canvas (or, if
    # none, the first): both engines then see an EOS mid-canvas.
    first_seen: dict[int, int] = {}
    for i, token in enumerate(free_run):
        first_seen.setdefault(token, i)
    inside = [(i, t) for t, i in first_seen.items() if 0 < i % length < length - 1]
    eos_pos, eos = max(inside, key=lambda it: (it[0] >= length, -it[0]))
    ref_ids, _ = reference_generate(ref, prompt, seed, max_new_tokens=max_tokens, eos_token_id=eos)
    (out,) = llm.generate(
        prompt, SamplingParams(max_tokens=max_tokens, seed=seed, eos_token_ids=(eos,))
    )
    assert out.output_ids == ref_ids[: eos_pos + 1] == free_run[: eos_pos + 1]
    assert out.output_ids[-1] == eos and out.finish_reason == "stop"
    assert all(
        t == llm.defaults.pad_token_id
        for t in ref_ids[eos_pos + 1 : (eos_pos // length + 1) * length]
    )


def test_non_default_decoding_parameters_match_reference(tiny_checkpoint, reference_model):
    path = tiny_checkpoint("c16")
    ref, llm = reference_model(path), LLM.from_pretrained(path, exact=True)
    settings = dict(
        max_denoising_steps=12,
        t_min=0.2,
        t_max=1.1,
        stability_threshold=2,
        confidence_threshold=0.3,
    )
    for seed, prompt in enumerate(prompts_for(llm)[:3]):
        ref_ids, _ = reference_generate(
            ref,
            prompt,
            seed,
            max_new_tokens=40,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.7),
            **settings,
        )
        (out,) = llm.generate(
            prompt, SamplingParams(max_tokens=40, seed=seed, entropy_bound=0.7, **settings)
        )
        assert out.output_ids == expected_prefix(ref_ids, set(llm.defaults.eos_token_ids), 40)
        assert all(1 <= s <= 12 for s in out.steps_per_canvas)


def test_same_seed_same_output_and_different_seeds_differ(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), exact=True)
    prompt = [5, 6, 7, 8]
    a, b, c = (llm.generate(prompt, SamplingParams(max_tokens=20, seed=s))[0] for s in (3, 3, 4))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
