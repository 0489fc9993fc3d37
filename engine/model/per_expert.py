"""Experts stored one tensor per expert, read as the fused tensors Canvas' kernels take.

llm-compressor writes the experts of an MoE model it quantizes as Linear modules, one per
expert and projection: for each layer's `<p>.experts` and each expert `e` < num_experts,
`<p>.experts.<e>.gate_proj.weight` and `<p>.experts.<e>.up_proj.weight` [I, H] and
`<p>.experts.<e>.down_proj.weight` [H, I], each F8_E4M3 beside its `weight_scale` [out, 1] (any
floating-point dtype), or each unquantized without one (experts on the `ignore` list). Canvas
reads them as the fused layout of the unquantized checkpoint (transformers' `gate_up_proj`:
each expert's gate rows, then its up rows): `<p>.experts.gate_up_proj` [E, 2I, H] and
`<p>.experts.down_proj` [E, H, I], and, when FP8, `<p>.experts.gate_up_proj_scale` [E, 2I, 1]
and `<p>.experts.down_proj_scale` [E, H, 1] in fp32 (`engine.model.quant`'s layout). A fused
tensor is made on the device it loads to and filled there one expert's projection at a time
from the memory-mapped file: a load never holds every expert's parts beside the fused tensor.

Refused with a CheckpointError naming the key: a missing expert or projection, an expert past
config.json's num_experts, a layer with both layouts, parts whose shapes or dtypes differ, an
FP8 part without its scale (or a scale beside an unquantized part), an FP8 part whose module
the `ignore` list names, and any other tensor under `<p>.experts.<e>.`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from engine.model.config import CheckpointError
from engine.model.quant import SAFETENSORS_FP8, SCALE_SUFFIX, Fp8Layout

# A tensor of one expert: `<p>.experts.<e>.<name>`.
PER_EXPERT = re.compile(r"(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<name>.+)$")
# Each fused tensor and the projections whose rows it stacks, in order.
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
WEIGHT = "weight"
SCALE = WEIGHT + SCALE_SUFFIX
# The tensors of one expert Canvas reads.
READ = tuple(
    f"{proj}.{what}" for proj in ("gate_proj", "up_proj", "down_proj") for what in (WEIGHT, SCALE)
)
Meta = Callable[[str], tuple[list[int], str]]  # a key's shape and safetensors dtype


def expert_weight(key: str) -> bool:
    """Whether checkpoint tensor `key` is one expert's projection weight (`<p>.experts.<e>.
    gate_proj.weight`, `up_proj`, `down_proj`)."""
    match = PER_EXPERT.match(key)
    return match is not None and match["name"] in READ and match["name"].endswith(f".{WEIGHT}")


@dataclass(frozen=True, slots=True)
class ExpertStack:
    """One fused tensor of `shape` read from per-expert tensors: `parts[e]`, the keys whose rows
    make expert e's slice, in order. `dtype`: the safetensors dtype it is read as (the parts'
    for weights; "F32" for scales, cast from the parts' as they are copied in)."""

    key: str
    parts: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]
    dtype: str

    def read(self, get: Callable[[str], torch.Tensor], device: str) -> torch.Tensor:
        """The fused tensor on `device`, filled one part at a time (`get(key)`: a part, e.g.
        memory-mapped)."""
        out: torch.Tensor | None = None  # [E, rows, cols], made with the first part's dtype
        for expert, keys in enumerate(self.parts):
            row = 0
            for key in keys:
                part = get(key)  # [rows, cols]
                if out is None:
                    dtype = torch.float32 if self.dtype == "F32" else part.dtype
                    out = torch.empty(self.shape, dtype=dtype, device=device)
                out[expert, row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
        assert out is not None, self.key  # a stack has num_experts >= 1 experts
        return out


def find_stacks(
    keys: Collection[str], meta: Meta, num_experts: int, layout: Fp8Layout | None
) -> dict[str, ExpertStack]:
    """The fused tensors that `keys` (a checkpoint's tensors) hold one tensor per expert, by
    fused key; {} for a checkpoint without per-expert tensors. CheckpointError naming the key
    for any case the module docstring refuses."""
    groups: dict[str, None] = {}  # each `<p>.experts` with tensors per expert, in key order
    for key in keys:
        match = PER_EXPERT.match(key)
        if match is None:
            continue
        if match["name"] not in READ:
            raise CheckpointError(
                f"tensor {key}: Canvas reads an expert's {', '.join(READ)} and nothing else"
            )
        expert = int(match["expert"])
        if expert >= num_experts:
            raise CheckpointError(
                f"tensor {key} is expert {expert}, but config.json has num_experts={num_experts}"
            )
        groups[match["experts"]] = None
    stacks = {}
    for experts in groups:
        for fused, projs in FUSED.items():
            if f"{experts}.{fused}" in keys:
                raise CheckpointError(
                    f"tensor {experts}.{fused} is fused, but {experts} also has tensors per "
                    f"expert ({experts}.0.{projs[0]}.weight, ...): one layout per layer"
                )
            weights = _weight_stack(experts, fused, projs, num_experts, meta, keys, layout)
            stacks[weights.key] = weights
            if weights.dtype == SAFETENSORS_FP8:
                scales = _scale_stack(weights, meta, keys)
                stacks[scales.key] = scales
            else:
                _refuse_scales(weights, keys)
    return stacks


def _weight_stack(
    experts: str,
    fused: str,
    projs: tuple[str, ...],
    num_experts: int,
    meta: Meta,
    keys: Collection[str],
    layout: Fp8Layout | None,
) -> ExpertStack:
    """`<experts>.<fused>` from its projections' weights, every expert's alike."""
    parts = tuple(
        tuple(f"{experts}.{e}.{proj}.{WEIGHT}" for proj in projs) for e in range(num_experts)
    )
    first = parts[0][0]
    first_shape, first_dtype = _meta(first, meta, keys)
    for expert in parts:
        for key in expert:
            shape, dtype = _meta(key, meta, keys)
            if dtype == SAFETENSORS_FP8 and layout is not None:
                module = key.removesuffix(f".{WEIGHT}")
                if layout.ignores(module):
                    raise CheckpointError(
                        f"tensor {key} is {SAFETENSORS_FP8} but quantization_config.ignore "
                        f"lists {module}"
                    )
            if dtype != first_dtype:
                raise CheckpointError(
                    f"tensor {key} has dtype {dtype} but {first} has {first_dtype}: Canvas reads "
                    f"a layer's experts ({experts}) all FP8 or all unquantized"
                )
            if len(shape) != 2 or shape != first_shape:
                raise CheckpointError(
                    f"tensor {key} has shape {shape}, but {first} has {first_shape}: every "
                    f"expert's {' and '.join(projs)} must be [rows, cols] of one shape"
                )
    fused_shape = (num_experts, len(projs) * first_shape[0], first_shape[1])
    return ExpertStack(f"{experts}.{fused}", parts, fused_shape, first_dtype)


def _scale_stack(weights: ExpertStack, meta: Meta, keys: Collection[str]) -> ExpertStack:
    """The scales [E, rows, 1] of the FP8 `weights`: each part's `weight_scale` [out, 1]."""
    parts = tuple(tuple(key + SCALE_SUFFIX for key in expert) for expert in weights.parts)
    for expert, scales in zip(weights.parts, parts, strict=True):
        for weight, key in zip(expert, scales, strict=True):
            if key not in keys:
                raise CheckpointError(f"missing tensor {key}: {weight} is {SAFETENSORS_FP8}")
            shape, _ = meta(key)
            rows = meta(weight)[0][0]
            if shape != [rows, 1]:
                raise CheckpointError(
                    f"tensor {key} has shape {shape}, expected [{rows}, 1] (a scale per output "
                    f"channel of {weight})"
                )
    return ExpertStack(weights.key + SCALE_SUFFIX, parts, (*weights.shape[:2], 1), "F32")


def _refuse_scales(weights: ExpertStack, keys: Collection[str]) -> None:
    for expert in weights.parts:
        for key in expert:
            if key + SCALE_SUFFIX in keys:
                raise CheckpointError(
                    f"tensor {key}{SCALE_SUFFIX} scales {key}, which is not {SAFETENSORS_FP8}"
                )


def _meta(key: str, meta: Meta, keys: Collection[str]) -> tuple[list[int], str]:
    if key not in keys:
        raise CheckpointError(
            f"missing tensor {key}: this checkpoint stores its experts one tensor per expert, "
            "and every expert's gate_proj, up_proj and down_proj must be there"
        )
    return meta(key)
