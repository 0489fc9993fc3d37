"""Twins of the FP8 weight kernels (part of `kernels.reference`'s namespace): a dense projection
and the experts over FP8 E4M3 weights with one fp32 scale per output channel
(`engine.model.quant`: value = fp8 * scale).

Each twin dequantizes the weight to the activations' dtype, then runs the unquantized path, so
every CPU test covers the FP8 layout. They are also what every backend binds for now: an FP8
GEMM (`torch._scaled_mm` with row-wise scales, FP8 activations) and an FP8 expert GEMM are the
kernels that would replace them, under these names and signatures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., Out, In] (float8_e4m3fn) times scale [..., Out, 1] (fp32), in fp32, cast to
    `dtype`."""
    return (weight.float() * scale).to(dtype)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, segments: list[int]
) -> torch.Tensor:
    """x [..., N, In] @ (weight * scale)[Out, In]^T: `reference.linear` on the dequantized
    weight (fast numerics; `segments` is ignored)."""
    del segments
    return F.linear(x, dequantize_fp8(weight, scale, x.dtype))


def fp8_moe_with(fused_moe: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The experts over FP8 weights through `fused_moe` (a backend's unquantized experts, with
    `reference.fused_moe`'s signature): both expert weights dequantized, then `fused_moe`."""

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
        """hidden [N, H]; gate_up [E, 2I, H] and down [E, H, I] in FP8 with their scales
        [E, 2I, 1] and [E, H, 1]; weights, ids [N, K]. Returns [N, H] as `fused_moe`."""
        gate_up = dequantize_fp8(gate_up, gate_up_scale, hidden.dtype)
        down = dequantize_fp8(down, down_scale, hidden.dtype)
        return fused_moe(hidden, gate_up, down, weights, ids, segments=segments)

    return fp8_moe
