"""`canvas plan`: the memory plan (`engine.device.memory`) of a model's real shapes on one A100,
H100 or H200, without a GPU: the model is built on the meta device from its config.json (or a
preset), its weights counted from the parameters' shapes and dtypes, the GPU's memory taken
from `engine.device.memory.GPUS`, and FP8 weights run by the kernels the Triton backend (a CUDA
engine's default) binds at that GPU's compute capability."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.device.memory import (
    GB,
    GPUS,
    TRITON,
    Fp8Paths,
    MemoryPlan,
    assumed_gpu,
    meta_model,
    model_shapes,
)
from engine.model.config import ModelConfig
from server.cli.config import DTYPE, ENGINE_FLAGS, EXACT, QUANTIZATION, add_flags, build_config

MEMORY_FLAGS = {"--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-tokens"}
MEMORY_FLAGS |= {"--gpu-memory-utilization", "--max-model-len", "--cuda-graphs"}
PLAN_FLAGS = (
    DTYPE,
    EXACT,
    QUANTIZATION,
    *(flag for flag in ENGINE_FLAGS if flag.name in MEMORY_FLAGS),
)
REAL_26B_A4B = "real-26b-a4b"  # google/diffusiongemma-26B-A4B-it's text stack, no checkpoint


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        help="a checkpoint directory, or a hub id org/name[@revision] whose config.json is in "
        "the local Hugging Face cache (or can be fetched); only config.json is read",
    )
    src.add_argument(
        "--preset",
        choices=(REAL_26B_A4B,),
        help="shapes without a checkpoint: real-26b-a4b is DiffusionGemma 26B-A4B's text stack "
        "(its vision tower not counted)",
    )
    parser.add_argument(
        "--gpu",
        required=True,
        choices=tuple(GPUS),
        help="the GPU assumed: its memory, and which FP8 kernels run (a100: sm_80, dequantizing)",
    )
    add_flags(parser, PLAN_FLAGS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The config --model or --preset names (CheckpointError, OSError naming the problem)."""
    from engine.model import load_model_config

    if args.preset == REAL_26B_A4B:
        from engine.checkpoints.tiny import REAL_26B_A4B_CANVAS_LENGTH, REAL_26B_A4B_TEXT_CONFIG
        from engine.model.config import parse_text_config

        text = parse_text_config(dict(REAL_26B_A4B_TEXT_CONFIG))
        return ModelConfig("diffusion_gemma", text, REAL_26B_A4B_CANVAS_LENGTH, "bfloat16")
    return load_model_config(config_dir(args))


def config_dir(args: argparse.Namespace) -> Path:
    """The directory holding --model's config.json (a hub id's: `hub_config_dir`)."""
    path = Path(args.model)
    if path.is_dir() or "/" not in args.model or path.is_absolute():
        return path
    return hub_config_dir(args.model)


def hub_config_dir(model: str) -> Path:
    """The local directory holding hub id `model`'s config.json: the Hugging Face cache's
    snapshot, fetched (config.json alone) when it is not cached. OSError naming --model."""
    import huggingface_hub

    repo, _, revision = model.partition("@")
    cached = huggingface_hub.try_to_load_from_cache(repo, "config.json", revision=revision or None)
    if isinstance(cached, str):
        return Path(cached).parent
    try:
        fetched = huggingface_hub.hf_hub_download(repo, "config.json", revision=revision or None)
    except Exception as exc:  # network, authorisation, a repository that does not exist
        raise OSError(
            f"--model {model}: no such directory, and its config.json is neither in the "
            f"Hugging Face cache nor downloadable ({type(exc).__name__}); pass a directory "
            "holding config.json, or --preset"
        ) from None
    return Path(fetched).parent


def plan_for(args: argparse.Namespace) -> MemoryPlan:
    """The plan the arguments describe (ValueError, OSError naming the flag at fault)."""
    from engine.device.memory import plan_memory
    from engine.model.loader import resolve_dtype
    from engine.model.quant import read_layout, refuse_exact

    config = model_config(args)
    build = build_config(args, None, PLAN_FLAGS)
    quantization = build.checkpoint.quantization
    if args.model is not None and read_layout(config_dir(args)) is not None:
        quantization = "fp8"  # an FP8 checkpoint's projections and experts
    refuse_exact(build.checkpoint.exact, "FP8 weights" if quantization == "fp8" else None)
    dtype = resolve_dtype(build.checkpoint.dtype, config)
    model = meta_model(config, dtype, quantization)
    fp8 = Fp8Paths.bound(TRITON, GPUS[args.gpu].capability)
    shapes = model_shapes(model, build.checkpoint.exact, fp8)
    return plan_memory(shapes, build.engine, assumed_gpu(args.gpu, shapes.weights_bytes))


def plan_text(plan: MemoryPlan) -> str:
    kv = plan.kv_positions
    taken = plan.total_bytes * plan.gpu_memory_utilization - plan.usable_bytes
    rows = [
        (f"{plan.device}", plan.total_bytes, "CUDA's total memory, assumed"),
        (
            f"at --gpu-memory-utilization {plan.gpu_memory_utilization}",
            plan.total_bytes * plan.gpu_memory_utilization,
            "",
        ),
        ("weights and CUDA context", taken, f"weights {plan.weights_bytes / GB:.2f} GB"),
        (
            "KV cache",
            plan.kv_bytes,
            f"{kv['full']:,} full-attention positions, {kv['sliding']:,} in sliding rings",
        ),
        ("sampler slots", plan.slot_bytes, ""),
        (
            "one step",
            plan.step_bytes,
            f"{plan.canvases_per_step} canvases per step ({plan.tokens_per_step:,} tokens)"
            + plan.graph_note(),
        ),
    ]
    lines = [f"  {name:<40} {size / GB:8.2f} GB  {note}".rstrip() for name, size, note in rows]
    lines.append(
        f"  running requests: {plan.max_running_requests} at --max-model-len "
        f"{plan.max_model_len:,} (bounded by {plan.limited_by})"
    )
    return "\n".join(["Memory plan", *lines])


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        plan = plan_for(args)
    except (ValueError, OSError) as exc:
        print(f"canvas plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_json(), indent=2) if args.json else plan_text(plan))
    return 0
