"""The sampler sharded over the vocabulary (`engine.parallel.sampler`) over two and four CPU
processes (gloo): from each rank's columns of random logits (odd vocabularies, split unevenly)
or of the parallel model's head (its `ShardPlan` slices), and its embedding rows, the samples,
argmax, entropy, log-normaliser and soft embedding are one device's
(`kernels.reference.sample_and_embed`) within the fast-numerics tolerance, the same on every
rank, and the tokens the same except where the uniform number lies within fp32 rounding of a
CDF boundary; the collectives move O(positions) bytes, as the roofline counts. One world per
size runs every check (forked ranks loading the tiny checkpoint's shards: seconds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.logits.processors import process_
from engine.model import load_model
from engine.parallel.loader import load_sharded
from engine.parallel.roofline import Collectives, sampler_collectives
from engine.parallel.sampler import ShardedSampler, apply_edits_, pack_mask
from engine.parallel.sampling import TOKEN, edit_of
from engine.parallel.world import World
from engine.request import RequestState
from kernels import reference
from tests.e2e.parallel_cases import REL_TOL, CountingWorld, spawn_world
from tests.e2e.sampler_cases import resolved

HIDDEN, SCALE = 8, 8**0.5
NUM_POSITIONS = 400
# (vocabulary, temperature): odd sizes split unevenly; a spread of temperatures; near 0.
CASES = {
    "warm": (1001, 1.0),
    "mixed": (997, None),  # per-position temperatures in [0.2, 2]
    "cold": (1001, 1e-4),
}
PRESET = "c32-window"  # the parallel model's test checkpoint (tests/e2e/test_parallel_tp.py)
MODEL_POSITIONS = 64
# A sum of V fp32 terms is within V * 2^-24 of its exact value (relative to the total), each
# order of summation alike: a sharded and a one-device CDF can disagree by twice that.
BOUNDARY_ULPS = 2 * 2.0**-24


def make_case(name: str) -> dict[str, torch.Tensor]:
    """A case's inputs, the same in every process: logits [P, V] (scaled so that the softmax
    is peaked, as a model's), temperatures and uniforms [P], the embedding [V, H]; a tie for
    the maximum across the first shard boundary in row 0 (the lowest id must win); in row 7,
    -inf over the first quarter of the vocabulary (a whole shard at 4 ranks)."""
    vocab, temperature = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    logits = torch.randn(NUM_POSITIONS, vocab, generator=gen) * 4
    logits[0, 3] = logits[0, vocab - 2] = 100.0
    logits[7, : vocab // 4] = float("-inf")  # all of rank 0's slice at 4 ranks
    if temperature is None:
        temps = torch.rand(NUM_POSITIONS, generator=gen) * 1.8 + 0.2
    else:
        temps = torch.full((NUM_POSITIONS,), temperature)
    uniform = torch.rand(NUM_POSITIONS, generator=gen)
    weight = torch.randn(vocab, HIDDEN, generator=gen)
    return {"logits": logits, "temperature": temps, "uniform": uniform, "weight": weight}


def bounds(vocab: int, size: int) -> list[int]:
    """Uneven slices of an odd vocabulary: rank r holds [bounds[r], bounds[r + 1])."""
    return [vocab * r // size for r in range(size + 1)]


def sampler_check(world: World, out_dir: Path, checkpoint: Path) -> None:
    """Rank check: each case through `sample_and_embed`, `fused_sample`, `argmax` and
    `sample_ar` (temperature 0 on every other position) from the rank's slice; then the
    parallel model's own slices (`model_slice_run`). Every rank saves its results and the
    payloads its collectives moved, per call."""
    saved: dict[str, Any] = {}
    for name, (vocab, _) in CASES.items():
        case = make_case(name)
        lo, hi = bounds(vocab, world.size)[world.rank : world.rank + 2]
        logits, weight = case["logits"][:, lo:hi], case["weight"][lo:hi]
        counting = CountingWorld(world)
        sampler = ShardedSampler(counting, lo)  # type: ignore[arg-type]
        result, soft = sampler.sample_and_embed(
            logits, case["temperature"], case["uniform"], weight, SCALE
        )
        saved[name] = {"result": result, "soft": soft, "counted": counting.counted}
        saved[name]["fused"] = sampler.fused_sample(logits, case["temperature"], case["uniform"])
        ar_temperature = case["temperature"].clone()
        ar_temperature[::2] = 0
        saved[name]["ar"] = sampler.sample_ar(logits, ar_temperature, case["uniform"])
        broken = logits.clone()
        broken[5, 0] = float("nan") if world.rank == world.size - 1 else broken[5, 0]
        broken[6] = float("-inf")
        saved[name]["argmax"] = sampler.argmax(broken)
        saved[name]["broken"] = sampler.fused_sample(broken, case["temperature"], case["uniform"])
    saved["model"] = model_slice_run(world, checkpoint)
    torch.save(saved, out_dir / f"sampler-{world.rank}.pt")


def model_inputs(hidden_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "hidden": torch.randn(MODEL_POSITIONS, hidden_size, generator=gen),
        "temperature": torch.rand(MODEL_POSITIONS, generator=gen) + 0.3,
        "uniform": torch.rand(MODEL_POSITIONS, generator=gen),
    }


@torch.inference_mode()
def model_slice_run(world: World, checkpoint: Path) -> dict[str, Any]:
    """The sampler over the parallel model's slices: the vocabulary-parallel head's logits
    (all-gathered, to compare; the sampler reads the rank's `plan.vocab_range` of them) and
    the rank's embedding rows."""
    sharded = load_sharded(checkpoint, world, kernels="twins")
    model, (lo, hi) = sharded.model, sharded.plan.vocab_range
    inputs = model_inputs(model.cfg.hidden_size)
    logits = model.logits(inputs["hidden"])  # [P, V]
    result, soft = ShardedSampler(world, lo).sample_and_embed(
        logits[:, lo:hi],
        inputs["temperature"],
        inputs["uniform"],
        model.embed_tokens.weight,
        float(model.embed_scale),
    )
    return {"logits": logits, "result": result, "soft": soft}


@pytest.fixture(scope="module")
def one_device(tiny_checkpoint: Callable[[str], Path]) -> torch.nn.Module:
    return load_model(tiny_checkpoint(PRESET), kernels="twins", adapter=False)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda size: f"{size}-ranks")
def world_run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_checkpoint: Callable[[str], Path],
    one_device: torch.nn.Module,  # loaded first: the forked ranks inherit what it imported
) -> tuple[int, list[dict[str, Any]]]:
    size = request.param
    out_dir = tmp_path_factory.mktemp(f"sampler-{size}")
    spawn_world(sampler_check, size, out_dir, tiny_checkpoint(PRESET))
    runs = [torch.load(out_dir / f"sampler-{r}.pt", weights_only=False) for r in range(size)]
    return size, runs


def near_boundary(case: dict[str, torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position, whether tokens `a` and `b` [P] can both be the inverse-CDF draw within
    fp32 rounding: every exact (fp64) cumulative probability from the lower one's to just before
    the higher one's lies within the rounding bound of the target u (zero mass between them).
    Positions where a == b are trivially so."""
    scaled = case["logits"].double() / case["temperature"].double()[:, None]
    cdf = scaled.softmax(-1).cumsum(-1)  # [P, V]
    vocab = cdf.shape[1]
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    u = case["uniform"].double()
    tol = BOUNDARY_ULPS * vocab
    first = (cdf.gather(1, lo[:, None])[:, 0] - u).abs() <= tol
    last = (cdf.gather(1, (hi - 1).clamp(min=0)[:, None])[:, 0] - u).abs() <= tol
    return (a == b) | (first & last)


def at_risk(case: dict[str, torch.Tensor]) -> torch.Tensor:
    """Positions [P] whose target lies within the rounding bound of some CDF boundary."""
    scaled = case["logits"].double() / case["temperature"].double()[:, None]
    cdf = scaled.softmax(-1).cumsum(-1)
    tol = BOUNDARY_ULPS * cdf.shape[1]
    return ((cdf - case["uniform"].double()[:, None]).abs() <= tol).any(-1)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_sampler_matches_one_device(
    world_run: tuple[int, list[dict[str, Any]]], name: str
) -> None:
    _, runs = world_run
    case = make_case(name)
    ref, ref_soft = reference.sample_and_embed(
        case["logits"], case["temperature"], case["uniform"], case["weight"], SCALE
    )
    got = runs[0][name]["result"]
    assert torch.equal(got.argmax, ref.argmax)
    assert int(got.argmax[0]) == 3  # the tie across shards: the lowest id
    assert torch.allclose(got.lse, ref.lse, rtol=REL_TOL, atol=0)
    assert torch.allclose(got.entropy, ref.entropy, rtol=0, atol=REL_TOL * 10)
    err = float((runs[0][name]["soft"] - ref_soft).abs().max())
    assert err <= REL_TOL * float(ref_soft.abs().max())
    differ = got.sample != ref.sample
    assert bool(near_boundary(case, got.sample, ref.sample).all()), "a token differs elsewhere"
    # the comparison counts only where few targets sit near a boundary
    risky = at_risk(case)
    assert int(differ.sum()) <= int(risky.sum()) < NUM_POSITIONS // 10
    if CASES[name][1] == 1e-4:  # near 0: one-hot, the sample is the argmax
        assert torch.equal(got.sample, ref.argmax)
    fused = runs[0][name]["fused"]
    assert torch.equal(fused.sample, got.sample) and torch.equal(fused.entropy, got.entropy)


def test_the_sampler_reads_the_parallel_models_own_slices(
    world_run: tuple[int, list[dict[str, Any]]], one_device: torch.nn.Module
) -> None:
    """The slices `ShardPlan.vocab_range` gives the head and the embedding are the ones the
    sampler's `vocab_start` names: one device's sampler over the gathered logits agrees."""
    _, runs = world_run
    saved = runs[0]["model"]
    inputs = model_inputs(one_device.cfg.hidden_size)
    case = {**inputs, "logits": saved["logits"]}
    weight, scale = one_device.embed_tokens.weight, float(one_device.embed_scale)
    ref, ref_soft = reference.sample_and_embed(
        saved["logits"], inputs["temperature"], inputs["uniform"], weight, scale
    )
    got = saved["result"]
    assert torch.equal(got.argmax, ref.argmax)
    assert bool(near_boundary(case, got.sample, ref.sample).all())
    assert torch.allclose(got.lse, ref.lse, rtol=REL_TOL, atol=0)
    err = float((saved["soft"] - ref_soft).abs().max())
    assert err <= REL_TOL * float(ref_soft.abs().max())
    assert all(torch.equal(run["model"]["soft"], saved["soft"]) for run in runs)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_gets_the_same_results(
    world_run: tuple[int, list[dict[str, Any]]], name: str
) -> None:
    _, runs = world_run
    first = runs[0][name]
    for other in runs[1:]:
        for field in ("sample", "argmax", "entropy", "lse"):
            assert torch.equal(
                getattr(other[name]["result"], field), getattr(first["result"], field)
            )
        assert torch.equal(other[name]["soft"], first["soft"])
        assert all(torch.equal(x, y) for x, y in zip(other[name]["ar"], first["ar"], strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_ar_paths_are_greedy_at_temperature_zero_and_flag_broken_rows(
    world_run: tuple[int, list[dict[str, Any]]], name: str
) -> None:
    _, runs = world_run
    case = make_case(name)
    saved = runs[0][name]
    tokens, failed = saved["ar"]
    ref = reference.fused_sample(case["logits"], case["temperature"], case["uniform"])
    assert torch.equal(tokens[::2], case["logits"][::2].argmax(-1))
    assert torch.equal(tokens[1::2], saved["fused"].sample[1::2])
    assert not failed.any() and torch.equal(saved["fused"].argmax, ref.argmax)
    ids, failed = saved["argmax"]
    assert failed.nonzero().flatten().tolist() == [5, 6]
    keep = torch.ones(NUM_POSITIONS, dtype=torch.bool)
    keep[5:7] = False
    assert torch.equal(ids[keep], case["logits"][keep].argmax(-1))
    broken_lse = saved["broken"].lse
    assert (~torch.isfinite(broken_lse)).nonzero().flatten().tolist() == [5, 6]


def test_collective_payload_is_per_position_not_per_vocabulary(
    world_run: tuple[int, list[dict[str, Any]]],
) -> None:
    size, runs = world_run
    counted = {runs[0][name]["counted"] for name in CASES}
    # the vocabularies (997 and 1001 tokens) move the same bytes: none scale with them; the
    # statistics' all-gather, the ids' all-reduce and the soft embedding's [P, H] (fp32)
    soft = Collectives(NUM_POSITIONS * HIDDEN * 4, 1)
    assert counted == {sampler_collectives(NUM_POSITIONS, size) + soft}
    assert sampler_collectives(NUM_POSITIONS, size) == Collectives(
        NUM_POSITIONS * 2 * 8, 1, NUM_POSITIONS * size * 3 * 4, 1
    )


def test_edits_on_each_slice_are_the_whole_rows_processors() -> None:
    """logit_bias, the penalties and an allowed-token mask, applied by each rank to its
    columns (uneven slices of an odd vocabulary, ids on both sides of the cut), give the whole
    row's processed values bit for bit (`engine.logits.batched`'s order: bias, penalties, mask)."""
    vocab, positions = 1001, 6
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(positions, vocab, generator=gen) * 5
    params = resolved(
        1,
        logit_bias={"7": 50.0, "600": -30.0, "1000": 2.5},
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    )
    req = RequestState("r", [3, 7, 700, 999], params, context=64, canvas_length=3)
    req.output_ids = [700, 5, 700, 600]
    allowed = torch.rand(positions, vocab, generator=gen) > 0.3
    whole = logits.clone()
    process_(whole, req)  # bias and penalties on the whole row, as one device does
    whole.masked_fill_(~allowed, float("-inf"))
    # rows 1.. of the call are this request's (row 0 another's: left as it is)
    edit = edit_of(req, 1, logits[1:], TOKEN)
    assert edit is not None and edit.allowed is None  # no grammar, no filters: no mask
    edit = dataclasses.replace(edit, allowed=pack_mask(allowed[1:]))
    parts = []
    for start, stop in ((0, 500), (500, vocab)):
        part = logits[:, start:stop].clone()
        apply_edits_(part, start, vocab, [edit])
        parts.append(part)
    got = torch.cat(parts, dim=-1)
    assert torch.equal(got[0], logits[0])
    assert torch.equal(got[1:], whole[1:])
