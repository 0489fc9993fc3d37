"""Twins of the FP8 weight kernels (part of `kernels.reference`'s namespace): a dense projection
and the experts over FP8 E4M3 weights with one fp32 scale per output channel
(`engine.model.quant`: value = fp8 * scale), and the per-token quantization of activations.

Each weight twin dequantizes the weight to the activations' dtype, then runs the unquantized
path, so every CPU test covers the FP8 layout. Their fast kernels (`kernels.triton_fp8`:
`torch._scaled_mm` over per-token FP8 activations on sm_90; `kernels.triton_moe.fp8_moe`: the
expert GEMM over FP8 weights dequantized in registers) take the same names and signatures.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The largest finite FP8 E4M3 (float8_e4m3fn) value.
FP8_MAX = 448.0
# The smallest row amax a per-token scale is computed from: an all-zero row gets a finite
# scale (its values quantize to zero) instead of a division by zero.
SCALE_FLOOR = 1e-12


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] to FP8 E4M3 with one fp32 scale per row: scale = max(amax, SCALE_FLOOR) / 448,
    values x / scale (fp32, clamped to +-448) cast to FP8. Returns (q [M, K], scale [M, 1]);
    q * scale approximates x (compressed-tensors' dynamic per-token activations)."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = amax.clamp(min=SCALE_FLOOR) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


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
