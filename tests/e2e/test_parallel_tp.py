"""Tensor and expert parallelism over two and four CPU processes (gloo): the sharded model's
forwards (prefill, denoise steps, a mixed batch) give the one-device logits within the
fast-numerics tolerance, move through the collectives what the roofline counts, and each rank
read and holds only its own shards; with rank 0 leading and the others following, the same
logits come out. One world per size runs every check. In one process, a logging world shows
each layer's dense-MLP all-reduce started before the experts run and waited for after them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.model import load_model
from engine.parallel.layers import parallelize
from engine.parallel.plan import ShardPlan
from engine.parallel.world import Pending
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


class LoggingWorld:
    """Rank 0 of 2 in one process: the collectives return their input (the other rank's part
    taken as zeros; an all-gather repeats it) and log themselves in `events`."""

    rank, size, device = 0, 2, torch.device("cpu")

    def __init__(self) -> None:
        self.events: list[str] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.events.append("reduce")
        return x

    def start_all_reduce(self, x: torch.Tensor) -> Pending:
        self.events.append("start")
        return Pending(x, self)

    def wait(self) -> None:  # the started collective's work handle
        self.events.append("wait")

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.events.append("gather")
        return torch.cat([x, x], dim=dim)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_the_dense_all_reduce_runs_while_the_experts_compute(
    tiny_checkpoint: Callable[[str], Path], expert_parallel: bool
) -> None:
    model = load_model(tiny_checkpoint(PRESET), kernels="twins", adapter=False)
    world = LoggingWorld()
    plan = ShardPlan(model.cfg, 0, 2, expert_parallel)
    parallelize(model, plan, world)  # type: ignore[arg-type]
    for layer in model.layers:
        run = layer.run_experts.run

        def logged(*args: object, run: Callable[..., torch.Tensor] = run) -> torch.Tensor:
            world.events.append("experts")
            return run(*args)

        layer.run_experts.run = logged
    run_scenario(model, plan.kv_config())
    starts = [i for i, event in enumerate(world.events) if event == "start"]
    assert len(starts) == 4 * model.cfg.num_layers  # four forwards
    # started after the dense MLP, waited for once the experts ran, before the MoE's reduce
    assert all(world.events[i + 1 : i + 4] == ["experts", "wait", "reduce"] for i in starts)
