"""Tensor and expert parallelism over two and four CPU processes (gloo): the sharded model's
forwards (prefill, denoise steps, a mixed batch) give the one-device logits within the
fast-numerics tolerance, move through the collectives what the roofline counts, and each rank
read and holds only its own shards; with rank 0 leading and the others following, the same
logits come out. One world per size runs every check."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.model import load_model
from engine.parallel.plan import ShardPlan
from tests.e2e.parallel_cases import (
    assert_logits_match,
    assert_ranks_hold_own_shards,
    forward_check,
    run_scenario,
    scenario_collectives,
    spawn_world,
)

# 4 q heads; 4 KV heads on sliding layers, 2 on the full one (replicated on 2 ranks each at 4
# ranks, as the real model's full layers are at TP=4); 4 experts
PRESET = "c32-window"
KINDS = ["tp", "ep"]


@pytest.fixture(scope="module")
def one_device(tiny_checkpoint: Callable[[str], Path]) -> torch.nn.Module:
    return load_model(tiny_checkpoint(PRESET), kernels="twins", adapter=False)


@pytest.fixture(scope="module")
def reference(one_device: torch.nn.Module) -> dict[str, torch.Tensor]:
    return run_scenario(one_device, one_device.cfg)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda size: f"{size}-ranks")
def world_run(
    request: pytest.FixtureRequest,
    tiny_checkpoint: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
    one_device: torch.nn.Module,  # loaded first: the forked ranks inherit what it imported
) -> tuple[int, Path]:
    size = request.param
    out_dir = tmp_path_factory.mktemp(f"world-{size}")
    spawn_world(forward_check, size, tiny_checkpoint(PRESET), out_dir)
    return size, out_dir


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_logits_match_one_device(
    world_run: tuple[int, Path], reference: dict[str, torch.Tensor], kind: str
) -> None:
    assert_logits_match(torch.load(world_run[1] / f"logits-{kind}.pt"), reference)


@pytest.mark.parametrize("kind", KINDS)
def test_collectives_move_what_the_roofline_counts(
    world_run: tuple[int, Path], one_device: torch.nn.Module, kind: str
) -> None:
    counted = torch.load(world_run[1] / f"collectives-{kind}.pt", weights_only=False)
    assert counted == scenario_collectives(one_device.cfg)


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_reads_and_holds_only_its_shards(
    world_run: tuple[int, Path], one_device: torch.nn.Module, kind: str
) -> None:
    size, out_dir = world_run
    plans = [ShardPlan(one_device.cfg, r, size, kind == "ep") for r in range(size)]
    assert_ranks_hold_own_shards(out_dir, kind, plans, one_device.state_dict())


def test_followers_run_the_leaders_calls_and_give_the_same_logits(
    world_run: tuple[int, Path],
) -> None:
    size, out_dir = world_run
    led = torch.load(out_dir / "logits-led.pt")
    direct = torch.load(out_dir / "logits-tp.pt")
    assert led.keys() == direct.keys()
    assert all(torch.equal(led[name], direct[name]) for name in direct)
    # four forwards, their four LM heads and one soft embedding
    assert [torch.load(out_dir / f"followed-{r}.pt") for r in range(1, size)] == [9] * (size - 1)
