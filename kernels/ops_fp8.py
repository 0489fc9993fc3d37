"""The FP8 weight kernels as `torch.library` custom ops, beside `kernels.ops_step`: the dense
projection `canvas::fp8_linear` and the experts `canvas::fp8_moe`, so that a step over FP8
weights runs on the meta device (the roofline's accountant costs them by their FP8 operands)
and traces without a graph break. `KernelSet.with_custom_ops()` binds them.

Implementations: the twins on the CPU (dequantize, then the unquantized path); on CUDA, Triton's
FP8 expert GEMM (`kernels.triton_moe.fp8_moe`) where Triton has E4M3 (sm_89 on; before it the
weights are dequantized for Triton's `fused_moe`), and `torch._scaled_mm` over per-token FP8
activations (`kernels.triton_fp8.fp8_linear`) where the device has row-wise scales, the twin
where it does not (`triton_fp8.e4m3_kernels`, `triton_fp8.scaled_mm_rowwise`).
"""

from __future__ import annotations

from typing import Any

import torch

import kernels.reference as reference
from kernels.op_support import cuda_impl, fake
from kernels.support import triton_available


@torch.library.custom_op("canvas::fp8_linear", mutates_args=())
def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return reference.fp8_linear(x, weight, scale, [])


@_fp8_linear.register_kernel("cuda")
def _fp8_linear_cuda(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if not triton_available():
        return reference.fp8_linear(x, weight, scale, [])
    import kernels.triton_fp8 as triton_fp8

    linear = triton_fp8.fp8_linear if triton_fp8.scaled_mm_rowwise() else reference.fp8_linear
    return linear(x, weight, scale, [])


@_fp8_linear.register_fake
def _fp8_linear_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fake(x, (*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("canvas::fp8_moe", mutates_args=())
def _fp8_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    return reference.fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids)


@_fp8_moe.register_kernel("cuda")
def _fp8_moe_cuda(*args: Any) -> torch.Tensor:
    if not triton_available():
        return reference.fp8_moe(*args)
    import kernels.triton_fp8 as triton_fp8

    if triton_fp8.e4m3_kernels():
        return cuda_impl("triton_moe", "fp8_moe")(*args)  # type: ignore[operator]
    return reference.fp8_moe_with(cuda_impl("triton_moe", "fused_moe"))(*args)  # type: ignore[arg-type]


@_fp8_moe.register_fake
def _fp8_moe_fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(hidden, hidden.shape)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, segments: list[int]
) -> torch.Tensor:
    """`reference.fp8_linear` as `canvas::fp8_linear` (`segments` ignored: fast)."""
    return torch.ops.canvas.fp8_linear(x, weight, scale)


def fp8_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """`reference.fp8_moe` as `canvas::fp8_moe` (`segments` ignored: fast)."""
    return torch.ops.canvas.fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids)
