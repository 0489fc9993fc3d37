"""The FP8 weight kernels as `torch.library` custom ops, beside `kernels.ops_step`: the dense
projection `canvas::fp8_linear` and the experts `canvas::fp8_moe`, and the FP8-rows kernels
(`canvas::rms_norm_fp8`, `canvas::rms_norm_pair_fp8`, `canvas::gated_act_fp8`,
`canvas::fp8_linear_rows`, `canvas::fp8_moe_rows`), so that a step over FP8 weights runs on
the meta device (the roofline's accountant costs them by their FP8 operands) and traces
without a graph break. `KernelSet.with_custom_ops()` binds them.

Implementations: the twins on the CPU (dequantize, then the unquantized path); on CUDA, Triton's
FP8 expert GEMM (`kernels.triton_moe.fp8_moe`) where Triton has E4M3 (sm_89 on; before it the
weights are dequantized for Triton's `fused_moe`), and `torch._scaled_mm` over per-token FP8
activations (`kernels.triton_fp8.fp8_linear`) where the device has row-wise scales, the twin
where it does not (`triton_fp8.e4m3_kernels`, `triton_fp8.scaled_mm_rowwise`); the FP8-rows
kernels' Triton launchers (`kernels.triton_fp8_emit`, `kernels.triton_fp8_moe`) where Triton has
E4M3, `triton_fp8.fp8_linear_rows` where the device has row-wise `_scaled_mm`.
"""

from __future__ import annotations

from collections.abc import Callable
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


# -- FP8 rows ----------------------------------------------------------------------------------

Tensors2 = tuple[torch.Tensor, torch.Tensor]
Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _cuda_rows_impl(module: str, name: str) -> Callable[..., Any]:
    """The CUDA implementation of an FP8-rows kernel: the Triton launcher where Triton has E4M3
    (`fp8_linear_rows`: where `_scaled_mm` has row-wise scales), the twin elsewhere."""
    if not triton_available():
        return getattr(reference, name)
    import kernels.triton_fp8 as triton_fp8

    ok = triton_fp8.scaled_mm_rowwise() if name == "fp8_linear_rows" else triton_fp8.e4m3_kernels()
    return cuda_impl(module, name) if ok else getattr(reference, name)  # type: ignore[return-value]


def _fp8_like(x: torch.Tensor) -> Tensors2:
    return fake(x, x.shape, torch.float8_e4m3fn), fake(x, (*x.shape[:-1], 1), torch.float32)


@torch.library.custom_op("canvas::rms_norm_fp8", mutates_args=())
def _rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> Tensors2:
    return reference.rms_norm_fp8(x, weight, eps)


@_rms_norm_fp8.register_kernel("cuda")
def _rms_norm_fp8_cuda(*args: Any) -> Tensors2:
    return _cuda_rows_impl("triton_fp8_emit", "rms_norm_fp8")(*args)


@_rms_norm_fp8.register_fake
def _rms_norm_fp8_fake(x: torch.Tensor, *args: Any) -> Tensors2:
    return _fp8_like(x)


@torch.library.custom_op("canvas::rms_norm_pair_fp8", mutates_args=())
def _rms_norm_pair_fp8(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> Tensors4:
    return reference.rms_norm_pair_fp8(x, weight_a, weight_b, eps)


@_rms_norm_pair_fp8.register_kernel("cuda")
def _rms_norm_pair_fp8_cuda(*args: Any) -> Tensors4:
    impl = _cuda_rows_impl("triton_fp8_emit", "rms_norm_pair_fp8")
    return impl(*args)


@_rms_norm_pair_fp8.register_fake
def _rms_norm_pair_fp8_fake(x: torch.Tensor, *args: Any) -> Tensors4:
    return (*_fp8_like(x), *_fp8_like(x))


@torch.library.custom_op("canvas::gated_act_fp8", mutates_args=())
def _gated_act_fp8(gate: torch.Tensor, up: torch.Tensor, activation: str) -> Tensors2:
    return reference.gated_act_fp8(gate, up, activation)


@_gated_act_fp8.register_kernel("cuda")
def _gated_act_fp8_cuda(*args: Any) -> Tensors2:
    return _cuda_rows_impl("triton_fp8_emit", "gated_act_fp8")(*args)


@_gated_act_fp8.register_fake
def _gated_act_fp8_fake(gate: torch.Tensor, *args: Any) -> Tensors2:
    return _fp8_like(gate)


@torch.library.custom_op("canvas::fp8_linear_rows", mutates_args=())
def _fp8_linear_rows(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    return reference.fp8_linear_rows(q, q_scale, weight, scale, dtype)


@_fp8_linear_rows.register_kernel("cuda")
def _fp8_linear_rows_cuda(*args: Any) -> torch.Tensor:
    return _cuda_rows_impl("triton_fp8", "fp8_linear_rows")(*args)


@_fp8_linear_rows.register_fake
def _fp8_linear_rows_fake(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    return fake(q, (*q.shape[:-1], weight.shape[0]), dtype)


@torch.library.custom_op("canvas::fp8_moe_rows", mutates_args=())
def _fp8_moe_rows(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    return reference.fp8_moe_rows(
        q, q_scale, gate_up, gate_up_scale, down, down_scale, weights, ids, dtype
    )


@_fp8_moe_rows.register_kernel("cuda")
def _fp8_moe_rows_cuda(*args: Any) -> torch.Tensor:
    return _cuda_rows_impl("triton_fp8_moe", "fp8_moe_rows")(*args)


@_fp8_moe_rows.register_fake
def _fp8_moe_rows_fake(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(q, q.shape, args[-1])


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> Tensors2:
    """`reference.rms_norm_fp8` as `canvas::rms_norm_fp8`."""
    return torch.ops.canvas.rms_norm_fp8(x, weight, eps)


def rms_norm_pair_fp8(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> Tensors4:
    """`reference.rms_norm_pair_fp8` as `canvas::rms_norm_pair_fp8`."""
    return torch.ops.canvas.rms_norm_pair_fp8(x, weight_a, weight_b, eps)


def gated_act_fp8(gate: torch.Tensor, up: torch.Tensor, activation: str) -> Tensors2:
    """`reference.gated_act_fp8` as `canvas::gated_act_fp8`."""
    return torch.ops.canvas.gated_act_fp8(gate, up, activation)


def fp8_linear_rows(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`reference.fp8_linear_rows` as `canvas::fp8_linear_rows`."""
    return torch.ops.canvas.fp8_linear_rows(q, q_scale, weight, scale, dtype)


def fp8_moe_rows(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """`reference.fp8_moe_rows` as `canvas::fp8_moe_rows` (`segments` ignored: fast)."""
    return torch.ops.canvas.fp8_moe_rows(
        q, q_scale, gate_up, gate_up_scale, down, down_scale, weights, ids, dtype
    )
