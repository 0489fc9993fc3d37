"""Tensor and expert parallelism over two CPU processes (gloo): the sharded model's forwards
(prefill, denoise steps, a mixed batch) give the one-device logits within the fast-numerics
tolerance, and each rank read and holds only its own shards. One world runs every check."""

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
    scenario_collectives,
    run_scenario,
    spawn_world,
)

SIZE = 2
PRESET = "c32-window"  # 4 q heads; 4 KV heads on sliding layers, 2 on the full one


@pytest.fixture(scope="module")
def one_device(tiny_checkpoint: Callable[[str], Path]) -> torch.nn.Module:
    return load_model(tiny_checkpoint(PRESET), kernels="twins", adapter=False)


@pytest.fixture(scope="module")
def world_run(
    tiny_checkpoint: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
    one_device: torch.nn.Module,  # loaded first: the forked ranks inherit what it imported
) -> Path:
    out_dir = tmp_path_factory.mktemp(f"world-{SIZE}")
    spawn_world(forward_check, SIZE, tiny_checkpoint(PRESET), out_dir)
    return out_dir


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_parallel_logits_match_one_device(
    world_run: Path, one_device: torch.nn.Module, kind: str
) -> None:
    ref = run_scenario(one_device, one_device.cfg)
    assert_logits_match(torch.load(world_run / f"logits-{kind}.pt"), ref)


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_each_rank_reads_and_holds_only_its_shards(
    world_run: Path, one_device: torch.nn.Module, kind: str
) -> None:
    plans = [ShardPlan(one_device.cfg, r, SIZE, kind == "ep") for r in range(SIZE)]
    assert_ranks_hold_own_shards(world_run, kind, plans, one_device.state_dict())


@pytest.mark.parametrize("kind", ["tp", "ep"])
def test_collectives_move_what_the_roofline_counts(
    world_run: Path, one_device: torch.nn.Module, kind: str
) -> None:
    counted = torch.load(world_run / f"collectives-{kind}.pt", weights_only=False)
    assert counted == scenario_collectives(one_device.cfg)
