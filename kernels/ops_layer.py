"""A layer's fused element-wise tails as `torch.library` custom ops, beside `kernels.ops_step`:
`canvas::add_rms_norm`, `canvas::rms_norm_pair`, `canvas::close_layer` and
`canvas::gated_act` (twins: `kernels.reference_layer`; Triton: `kernels.triton_layer`).
`KernelSet.with_custom_ops()` binds the wrappers at the end; their implementations are the fast
twins on the CPU and the Triton launchers on CUDA (`kernels.op_support.cuda_impl`)."""

from __future__ import annotations

from typing import Any

import torch

import kernels.reference as reference
from kernels.op_support import cuda_impl, fake


@torch.library.custom_op("canvas::add_rms_norm", mutates_args=())
def _add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    return reference.add_rms_norm(residual, x, weight, eps)


@_add_rms_norm.register_kernel("cuda")
def _add_rms_norm_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_layer", "add_rms_norm")(*args)  # type: ignore[operator]


@_add_rms_norm.register_fake
def _add_rms_norm_fake(residual: torch.Tensor, x: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(x, x.shape)


@torch.library.custom_op("canvas::rms_norm_pair", mutates_args=())
def _rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.rms_norm_pair(x, weight_a, weight_b, eps)


@_rms_norm_pair.register_kernel("cuda")
def _rms_norm_pair_cuda(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return cuda_impl("triton_layer", "rms_norm_pair")(*args)  # type: ignore[operator]


@_rms_norm_pair.register_fake
def _rms_norm_pair_fake(x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return fake(x, x.shape), fake(x, x.shape)


@torch.library.custom_op("canvas::close_layer", mutates_args=())
def _close_layer(
    dense: torch.Tensor,
    moe: torch.Tensor,
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    moe_weight: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    return reference.close_layer(dense, moe, residual, dense_weight, moe_weight, weight, scale, eps)


@_close_layer.register_kernel("cuda")
def _close_layer_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_layer", "close_layer")(*args)  # type: ignore[operator]


@_close_layer.register_fake
def _close_layer_fake(dense: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(dense, dense.shape)


@torch.library.custom_op("canvas::gated_act", mutates_args=())
def _gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return reference.gated_act(gate, up, activation)


@_gated_act.register_kernel("cuda")
def _gated_act_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_layer", "gated_act")(*args)  # type: ignore[operator]


@_gated_act.register_fake
def _gated_act_fake(gate: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(gate, gate.shape)


# -- the wrappers KernelSet binds (the twins' signatures) ------------------------------------


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`reference.add_rms_norm` as `canvas::add_rms_norm`."""
    return torch.ops.canvas.add_rms_norm(residual, x, weight, eps)


def rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm_pair` as `canvas::rms_norm_pair`."""
    return torch.ops.canvas.rms_norm_pair(x, weight_a, weight_b, eps)


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
    """`reference.close_layer` as `canvas::close_layer`."""
    return torch.ops.canvas.close_layer(
        dense, moe, residual, dense_weight, moe_weight, weight, scale, eps
    )


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`reference.gated_act` as `canvas::gated_act`."""
    return torch.ops.canvas.gated_act(gate, up, activation)
