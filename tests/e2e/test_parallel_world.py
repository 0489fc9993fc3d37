"""The parallel model's edges, in this process: a world that cannot form says why (the port is
taken, a rank never comes, too few GPUs), a size that does not divide the model is refused
naming the quantity, a rank that dies fails the others' next call at once, one rank through
the parallel path is the one-device model bit for bit, and `canvas serve` refuses by name
what it does not run over ranks (--exact, FP8, an adapter; a size that does not divide the
model)."""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.model import load_model, load_model_config
from engine.parallel.layers import parallelize
from engine.parallel.loader import load_sharded
from engine.parallel.plan import ShardPlan
from engine.parallel.ranks import Ranks, RankSpec
from engine.parallel.world import World, WorldError, free_port, init_world
from server.cli import main
from tests.e2e.parallel_cases import dead_rank_check, run_scenario, spawn_world

PRESET = "c32-window"


def test_rank_zero_names_a_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(WorldError, match=f"port {port} is in use"):
            init_world(0, 2, "gloo", f"tcp://127.0.0.1:{port}", timeout_s=5)


def test_a_rank_whose_world_never_forms_times_out_clearly() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # no rank 0 listens there
    with pytest.raises(WorldError, match="rank 1 of 2 could not join the world .* within 1 s"):
        init_world(1, 2, "gloo", address, timeout_s=1)


def test_nccl_refuses_more_ranks_than_cuda_devices() -> None:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    size = found + 1
    with pytest.raises(WorldError, match=f"needs {size} CUDA devices, found {found}"):
        init_world(0, size, "nccl")


def test_rank_outside_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        init_world(2, 2, "gloo")


def test_sizes_that_do_not_divide_the_model_are_refused_by_name(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    cfg = load_model_config(tiny_checkpoint(PRESET)).text  # 4 q heads, 4 and 2 KV heads
    with pytest.raises(ValueError, match="8 ranks must divide num_attention_heads=4"):
        ShardPlan(cfg, 0, 8)
    with pytest.raises(ValueError, match="3 ranks must divide layer 0's 4 KV heads"):
        ShardPlan(cfg, 0, 3)
    ShardPlan(cfg, 0, 4, expert_parallel=True)  # 4 experts: one each


def test_parallelize_refuses_fp8_weights(tiny_checkpoint: Callable[[str], Path]) -> None:
    model = load_model(tiny_checkpoint(PRESET), kernels="twins", adapter=False, quantization="fp8")
    plan = ShardPlan(model.cfg, 0, 2)
    with pytest.raises(ValueError, match="does not run FP8 weights"):
        parallelize(model, plan, World(0, 2, torch.device("cpu")))


@pytest.mark.parametrize("dead", [1, 0], ids=["follower-dies", "leader-dies"])
def test_a_dead_rank_fails_the_others_at_once(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path, dead: int
) -> None:
    checkpoint = tiny_checkpoint(PRESET)
    load_model(checkpoint, kernels="twins", adapter=False)  # the forked ranks inherit imports
    spawn_world(dead_rank_check, 2, checkpoint, tmp_path, dead)
    error, seconds = torch.load(tmp_path / f"dead-{1 - dead}.pt")
    assert error.startswith("a rank left the world during "), error
    assert seconds < 10  # the collective's timeout is 60 s: nothing waited for it


def test_one_rank_through_the_parallel_path_is_the_one_device_model(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    checkpoint = tiny_checkpoint(PRESET)
    model = load_model(checkpoint, kernels="twins", adapter=False)
    sharded = load_sharded(checkpoint, World(0, 1, torch.device("cpu")), kernels="twins")
    ours = run_scenario(sharded.model, sharded.plan.kv_config())
    for name, ref in run_scenario(model, model.cfg).items():
        assert torch.equal(ours[name], ref), name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["-tp", "2", "--exact"], "--exact runs on one device only: --tensor-parallel-size 2"),
        (["-tp", "2", "--quantization", "fp8"], "--quantization fp8 is not run over ranks"),
        (["-tp", "2", "--adapter", "/a"], "--adapter DIR: a decoder adapter is not run over"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
        (["--enable-expert-parallel"], "--enable-expert-parallel splits the experts over"),
        (["-tp", "3"], "3 ranks must divide layer 0's 4 KV heads"),
    ],
)
def test_serve_refuses_tensor_parallelism_it_cannot_serve(
    tiny_checkpoint: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    argv = ["serve", "--model", str(tiny_checkpoint(PRESET)), "--port", "0", *flags]
    assert main(argv) == 2
    assert f"canvas serve: error: {message}" in capsys.readouterr().err


def in_fresh_process(check: Callable[..., None], *args: object) -> None:
    """Run `check(*args)` in a spawned process: a world that failed to form (here, or in a
    process this one forked from) leaves torch's group counter moved on, and a world formed
    there would wait for names that its freshly spawned followers never use. Fails unless the
    check passed."""
    process = multiprocessing.get_context("spawn").Process(target=check, args=args)
    process.start()
    process.join(180)
    assert process.exitcode == 0, "the check failed in its process (its error above)"


def dies_before_joining(checkpoint: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    # threads=0: torch refuses it, so rank 1 exits before it joins
    spec = RankSpec(checkpoint, 2, False, "auto", "twins", address, "gloo", 0)
    ranks = Ranks(spec)
    start = time.monotonic()
    try:
        with pytest.raises(WorldError, match="ranks cannot form: rank 1 exited with code 1"):
            ranks.join_world()
        assert time.monotonic() - start < spec.timeout_s / 2  # not the formation's timeout
    finally:
        ranks.stop()


def cannot_load(checkpoint: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = Ranks(RankSpec(checkpoint, 2, False, "float8", "twins", address, "gloo", 1))
    try:
        ranks.join_world()
        with pytest.raises(WorldError, match="rank 1 could not load its shard: ValueError: .*"):
            ranks.gather("load its shard")
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.procs] == [1]


@pytest.mark.parametrize("check", [dies_before_joining, cannot_load], ids=lambda c: c.__name__)
def test_a_follower_that_cannot_start_fails_start_up_at_once_naming_it(
    tiny_checkpoint: Callable[[str], Path], check: Callable[[Path], None]
) -> None:
    in_fresh_process(check, tiny_checkpoint(PRESET))
