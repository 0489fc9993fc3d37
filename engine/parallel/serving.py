"""Serving over ranks: what `canvas serve --tensor-parallel-size N` accepts
(`check_tensor_parallel`) and how rank 0 starts (`start_ranks`): it spawns the followers
(`engine.parallel.ranks`), forms the world, loads its own shard and returns it with the
followers' handle; `Ranks.serve` then sizes their KV caches like the engine's and makes the
engine's model calls lead them (`engine.parallel.step`). Rank 0 schedules and allocates pages
as one device does; its sampler (`engine.parallel.sampling.ShardedSampling`) runs on every
rank over each one's vocabulary slice of the LM head and of the embedding: no rank holds
another's rows, and the logits are all-gathered only for the rows a feature reads whole
(docs/parallelism.md). Exact numerics, FP8, decoder adapters and CUDA graphs are refused by
name with more than one rank."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model.adapter import ADAPTER_SUBDIR
from engine.model.base import DiffusionLM
from engine.model.fp8_checkpoint import read_layout
from engine.model.loader import load_model_config, resolve_device
from engine.parallel.loader import load_sharded
from engine.parallel.plan import ShardPlan
from engine.parallel.ranks import Ranks, RankSpec
from engine.parallel.sampling import ShardedSampling
from engine.parallel.step import Leader
from engine.parallel.world import WorldError, check_port_free, free_port

if TYPE_CHECKING:
    from engine.build import CheckpointConfig
    from engine.engine import Engine

logger = logging.getLogger(__name__)

PARALLELISM_DOC = "docs/parallelism.md"
PORT_ENV = "MASTER_PORT"  # torch.distributed's variable: the world's port when no flag names one


def check_tensor_parallel(config: CheckpointConfig) -> None:
    """ValueError, naming the flag, for what serving over `config.tensor_parallel_size` ranks
    does not run: a size below 1, `--enable-expert-parallel` on one rank, and with several
    ranks exact numerics (a sum split over ranks reorders the reductions whose bits the
    reference's tokens depend on), FP8 quantization and an adapter directory."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        if config.expert_parallel:
            raise ValueError(
                "--enable-expert-parallel splits the experts over ranks: it needs "
                "--tensor-parallel-size 2 or more"
            )
        return
    flag = f"--tensor-parallel-size {size}"
    refused = {
        "--exact runs on one device only": config.exact,
        "--quantization fp8 is not run over ranks yet": config.quantization == "fp8",
        "--adapter DIR: a decoder adapter is not run over ranks yet": not isinstance(
            config.adapter, bool
        ),
    }
    for what, given in refused.items():
        if given:
            raise ValueError(
                f"{what}: {flag} splits the model ({PARALLELISM_DOC}); drop the flag or use "
                "--tensor-parallel-size 1"
            )


def serve_ranks(ranks: Ranks | None, engine: Engine) -> None:
    """Make `engine` (built on rank 0's model from `start_ranks`) lead the followers: their KV
    caches sized like its own, its model calls and page copies sent to them (nothing without
    `ranks`: one device). ValueError for `--cuda-graphs` (a replayed graph would skip the
    calls)."""
    if ranks is None:
        return
    if engine.config.cuda_graphs:
        raise ValueError(
            f"--cuda-graphs is not run with --tensor-parallel-size {ranks.spec.size} yet"
        )
    assert ranks.world is not None, "start_ranks formed the world"
    leader = Leader(engine.model, ranks.world, ranks.pipes)
    ranks.serve(leader, engine.runner.cache)
    sampling = ShardedSampling(engine, leader)
    sampling.watch()
    engine.sampling = sampling


def start_ranks(model_dir: Path, config: CheckpointConfig) -> tuple[DiffusionLM, Ranks]:
    """Rank 0's model and its followers for `config` (`config.tensor_parallel_size` > 1): the
    followers spawned, the world formed, rank 0's shard loaded (its vocabulary slice of the
    embedding, as every rank's), its `cfg` its own heads' (the engine sizes its KV cache by
    it). WorldError where the world cannot form or a follower cannot load; ValueError where
    the size does not divide the model or the checkpoint is FP8."""
    size = config.tensor_parallel_size
    if read_layout(model_dir) is not None:
        raise ValueError(f"--tensor-parallel-size {size} does not run an FP8 checkpoint yet")
    plan = ShardPlan(load_model_config(model_dir).text, 0, size, config.expert_parallel)
    if config.adapter is True and (model_dir / ADAPTER_SUBDIR).is_dir():
        logger.warning("the checkpoint's decoder adapter is not run over ranks: serving without")
    device = resolve_device(config.device)
    port = config.distributed_port or int(os.environ.get(PORT_ENV) or 0) or free_port()
    try:
        check_port_free(f"tcp://127.0.0.1:{port}")  # before any follower could join a stranger
    except WorldError as exc:
        raise WorldError(f"--distributed-port / ${PORT_ENV}: {exc}") from None
    spec = RankSpec(
        model_dir=model_dir,
        size=size,
        expert_parallel=config.expert_parallel,
        dtype=config.dtype,
        kernels=config.kernels,
        init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo" if device.startswith("cpu") else "nccl",
        threads=max(1, (os.cpu_count() or 1) // size),
    )
    ranks = Ranks(spec)
    try:
        world = ranks.join_world()
        sharded = load_sharded(
            model_dir, world, config.expert_parallel, config.dtype, config.kernels
        )
        ranks.gather("load its shard")
    except BaseException:
        ranks.stop()
        raise
    model = sharded.model
    model.cfg = plan.kv_config()
    logger.info(
        "rank 0 of %d (%s): %.1f MB of its shard read; the others ready to load their KV caches",
        size,
        spec.backend,
        sharded.bytes_read / 1e6,
    )
    return model, ranks
