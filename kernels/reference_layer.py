"""Twins of a layer's fused element-wise tails (part of `kernels.reference`'s namespace): the
Gemma sandwich norms with the residual adds around them, and the gated MLP's activation
product. Each kernel here is a short sequence of the ops the layer ran one by one, in the
same order with the same roundings, so a Triton kernel can do it in one pass over its rows
(`kernels.triton_layer`) where the unfused layer made 3-6 passes and launches.

Each norm-bearing twin comes twice: `*_exact` with `rms_norm` (the reference's six fp32
passes, out of place: exact numerics and training run it) and the fast one with
`rms_norm_fused`, which on the CPU also works in place where nothing else reads the
intermediate. Both are the unfused layer's values bit for bit under their numerics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.reference_norm import SMALL_NORM, rms_norm, rms_norm_fused

Norm = Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]

# Activations of a gated MLP by their config names (`hidden_activation` / `hidden_act`).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def _in_place() -> bool:
    """Whether a fast twin may reuse its intermediates (autograd needs them kept)."""
    return not torch.is_grad_enabled()


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual + rms_norm(x, weight): a post-norm and the residual add after it (attention's
    `post_attention_layernorm`). x and residual of one shape and dtype."""
    normed = rms_norm_fused(x, weight, eps)
    return normed.add_(residual) if _in_place() else normed + residual


def add_rms_norm_exact(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return residual + rms_norm(x, weight, eps)


def rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x, weight_a), rms_norm(x, weight_b)): two norms of one input (the dense MLP's
    and the experts' pre-norms), reading x and finding its mean square once."""
    fp32 = x.dtype == weight_a.dtype == torch.float32
    # A few rows: two single `F.rms_norm` calls beat the shared passes' eight dispatches.
    if x.device.type != "cpu" or not fp32 or x.numel() <= SMALL_NORM:
        return rms_norm_fused(x, weight_a, eps), rms_norm_fused(x, weight_b, eps)
    # `rms_norm_fused`'s CPU sequence, (x * inv) * weight, with x * inv shared.
    inv = torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_().unsqueeze(-1)
    normed = x * inv
    second = normed * weight_b
    return (normed.mul_(weight_a) if _in_place() else normed * weight_a), second


def rms_norm_pair_exact(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm(x, weight_a, eps), rms_norm(x, weight_b, eps)


def close_layer(
    dense: torch.Tensor,
    moe: torch.Tensor,
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    moe_weight: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The end of DiffusionGemma's layer: (residual + rms_norm(rms_norm(dense, dense_weight) +
    rms_norm(moe, moe_weight), weight)) * scale — the two branches' post-norms, their sum, the
    outer post-norm, the residual add and the layer scalar (`scale`: [1], or one value per
    token broadcast against the rows, e.g. [1, N, 1])."""
    return close_layer_with(rms_norm_fused, _in_place(), dense, moe, residual, dense_weight,
                            moe_weight, weight, scale, eps)  # fmt: skip


def close_layer_with(
    norm: Norm,
    in_place: bool,
    dense: torch.Tensor,
    moe: torch.Tensor,
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    moe_weight: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`close_layer`'s sequence with a given norm; `in_place`: reuse the intermediates."""
    branches = norm(dense, dense_weight, eps)
    moe_normed = norm(moe, moe_weight, eps)
    if not in_place:
        return (residual + norm(branches + moe_normed, weight, eps)) * scale
    out = norm(branches.add_(moe_normed), weight, eps).add_(residual)
    return out.mul_(scale) if out.dtype == torch.result_type(out, scale) else out * scale


# `close_layer` with the reference's norm, out of place (exact numerics, training).
close_layer_exact = functools.partial(close_layer_with, rms_norm, False)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up: a gated MLP's product (GeGLU with "gelu_pytorch_tanh", SwiGLU with
    "silu"), in the dtype of its inputs as the unfused ops."""
    act = ACTIVATIONS[activation](gate)
    return act.mul_(up) if _in_place() else act * up
