"""The sharded loader: each rank builds the model on the meta device, cuts it to its shard
(`engine.parallel.layers.parallelize`) and reads from the safetensors files only its slices of
each tensor (`safe_open(...).get_slice(key)[...]`), so no rank ever holds a whole sharded
tensor, nor another rank's part of it. The vision tower, where the weights hold one, is
replicated (each rank reads it whole)."""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model.base import DiffusionLM
from engine.model.config import CheckpointError
from engine.model.loader import (
    BACKBONES,
    SAFETENSORS_DTYPES,
    VISION_PREFIXES,
    checkpoint_names,
    load_model_config,
    resolve_dtype,
    weight_files,
)
from engine.parallel.layers import parallelize
from engine.parallel.plan import ShardPlan
from engine.parallel.world import World
from kernels import resolve_kernels

BYTES_PER_ELEMENT = {"F32": 4, "BF16": 2, "F16": 2}


@dataclass(frozen=True, slots=True)
class ShardedModel:
    """One rank's model, its plan (`plan.kv_config()` sizes its KV cache) and the bytes its
    loader read from the checkpoint files (its slices and the replicated tensors, no more)."""

    model: DiffusionLM
    plan: ShardPlan
    bytes_read: int


def load_sharded(
    model_dir: str | Path,
    world: World,
    expert_parallel: bool = False,
    dtype: str = "auto",
    kernels: str = "auto",
) -> ShardedModel:
    """Rank `world.rank`'s shard of the checkpoint in `model_dir` on `world.device`, in fast
    numerics on the `kernels` backend, without an adapter (the parallel model runs none).
    CheckpointError naming the tensor that is missing or has another shape or dtype than
    config.json implies; ValueError where the world's size does not divide the model
    (`ShardPlan`)."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    target = resolve_dtype(dtype, config)
    plan = ShardPlan(config.text, world.rank, world.size, expert_parallel)
    state, bytes_read = {}, 0
    with ExitStack() as stack:
        where = _open(weight_files(model_dir), stack)
        if not any(key.startswith(tuple(VISION_PREFIXES.values())) for key in where):
            config = dataclasses.replace(config, vision=None)  # a text-only export
        with torch.device("meta"):
            model = BACKBONES[config.model_type](config)
        full_shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
        parallelize(model, plan, world)
        for name, shape in full_shapes.items():
            key = next((c for c in checkpoint_names(name) if c in where), None)
            if key is None:
                raise CheckpointError(f"missing tensor {checkpoint_names(name)[0]} ({shape})")
            stored = where[key].get_slice(key)
            st_dtype = stored.get_dtype()
            if list(stored.get_shape()) != shape:
                raise CheckpointError(
                    f"tensor {key} has shape {stored.get_shape()}, expected {shape} from "
                    "config.json"
                )
            if st_dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"tensor {key} has dtype {st_dtype}, expected a float")
            shard = plan.shard(name)
            tensor = stored[:] if shard is None else shard.take(stored)
            bytes_read += tensor.numel() * BYTES_PER_ELEMENT[st_dtype]
            state[name] = tensor.to(world.device, target)
    model.load_state_dict(state, assign=True, strict=True)
    model.init_rope(world.device)
    model.bind_kernels(resolve_kernels(world.device.type, kernels, exact=False))
    return ShardedModel(model.eval().requires_grad_(False), plan, bytes_read)


def _open(files: list[Path], stack: ExitStack) -> dict[str, Any]:
    """Checkpoint key → its open (memory-mapped) safetensors file."""
    where: dict[str, Any] = {}
    for path in files:
        handle = stack.enter_context(safe_open(str(path), framework="pt"))
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            where[key] = handle
    return where
