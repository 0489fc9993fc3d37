"""Twins of the FP8 weight kernels (part of `kernels.reference`'s namespace): a dense projection
and the experts over FP8 E4M3 weights with one fp32 scale per output channel
(`engine.model.quant`: value = fp8 * scale), and the per-token quantization of activations.

Each weight twin dequantizes the weight to the activations' dtype, then runs the unquantized
path, so every CPU test covers the FP8 layout. Their fast kernels (`kernels.triton_fp8`:
`torch._scaled_mm` over per-token FP8 activations on sm_90; `kernels.triton_moe.fp8_moe`: the
expert GEMM over FP8 weights dequantized in registers) take the same names and signatures.

FP8 rows (sm_90's path, `KernelSet.with_fp8_rows`): the norms and the GeGLU product that feed
FP8 projections emit their output as FP8 with per-token scales (`rms_norm_fp8`,
`rms_norm_pair_fp8`, `gated_act_fp8`: the unquantized kernel, then `quantize_fp8_rows`), which
the projections (`fp8_linear_rows`) and the experts (`fp8_moe_rows`, FP8 x FP8) take as they
are: no quantizer between them. The projection twins dequantize both operands in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.reference_layer import ACTIVATIONS, gated_act, rms_norm_pair
from kernels.reference_norm import rms_norm_fused

# The largest finite FP8 E4M3 (float8_e4m3fn) value.
FP8_MAX = 448.0
# The smallest row amax a per-token scale is computed from: an all-zero row gets a finite
# scale (its values quantize to zero) instead of a division by zero.
SCALE_FLOOR = 1e-12
# Columns per scale of the experts' GeGLU output (`fp8_moe_rows`): a program of the gate/up GEMM
# sees one block of columns of a row, not the whole row, so it quantizes per (row, block).
ACT_GROUP = 128


@dataclass(frozen=True, slots=True)
class Fp8Rows:
    """Activations quantized per token, as FP8 projections take them: `values` [..., K]
    float8_e4m3fn, `scale` [..., 1] fp32 (values * scale approximates the rows), `dtype` the
    activations' own (the projections' output dtype)."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def reshape(self, shape: Sequence[int]) -> Fp8Rows:
        """The same rows under another leading shape (the last dimension kept)."""
        lead = tuple(shape)[:-1]
        return Fp8Rows(self.values.reshape(tuple(shape)), self.scale.reshape(*lead, 1), self.dtype)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] to FP8 E4M3 with one fp32 scale per row: scale = max(amax, SCALE_FLOOR) / 448,
    values x / scale (fp32, clamped to +-448) cast to FP8. Returns (q [..., K], scale [..., 1]);
    q * scale approximates x (compressed-tensors' dynamic per-token activations)."""
    amax = x.float().abs().amax(-1, keepdim=True)
    scale = amax.clamp(min=SCALE_FLOOR) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] to FP8 E4M3 with one fp32 scale per row and block of `group` columns (the last
    block may be short): (q [M, K], scale [M, ceil(K / group)]), each block as
    `quantize_fp8_rows` quantizes a row."""
    num_rows, num_cols = x.shape
    pad = -num_cols % group
    blocks = F.pad(x.float(), (0, pad)).view(num_rows, -1, group)
    q, scale = quantize_fp8_rows(blocks)
    return q.view(num_rows, -1)[:, :num_cols], scale.squeeze(-1)


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


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_fused(x, weight, eps)` (rounded to x's dtype, as the unquantized norm stores
    it) quantized per token: (FP8 [..., D], fp32 scales [..., 1])."""
    return quantize_fp8_rows(rms_norm_fused(x, weight, eps))


def rms_norm_pair_fp8(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rms_norm_pair`'s two norms, each quantized per token: (FP8 a, scales a, FP8 b, scales
    b), shapes [..., D] and [..., 1]."""
    normed_a, normed_b = rms_norm_pair(x, weight_a, weight_b, eps)
    return (*quantize_fp8_rows(normed_a), *quantize_fp8_rows(normed_b))


def gated_act_fp8(
    gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_act(gate, up, activation)` (in the inputs' dtype) quantized per token."""
    return quantize_fp8_rows(gated_act(gate, up, activation))


def fp8_linear_rows(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """FP8 rows q [..., N, In] with their per-token scales [..., N, 1] times (weight * scale)
    [Out, In]^T: both operands dequantized in fp32, the product in fp32, one rounding to
    `dtype` (`torch._scaled_mm`'s row-wise contract)."""
    return F.linear(q.float() * q_scale, weight.float() * scale).to(dtype)


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
    """The GeGLU experts over FP8 rows q [N, H] (per-token scales [N, 1]) and FP8 weights
    (gate_up [E, 2I, H], down [E, H, I], scales [E, 2I, 1], [E, H, 1]); weights, ids [N, K].
    Returns [N, H] in `dtype`. Per pair: gate and up in fp32 from both dequantized operands,
    each rounded to `dtype`; gelu(gate) * up rounded to `dtype`, then quantized per
    `ACT_GROUP` columns; down in fp32, rounded to `dtype`, times the routing weight, rounded
    to `dtype`; the pairs summed over the slots in fp32 (`segments` is ignored: fast)."""
    del segments
    top_k, (num_tokens, hidden) = ids.shape[1], q.shape
    x = q.float() * q_scale  # [N, H]
    flat = ids.reshape(-1)
    pair_rows = torch.zeros(flat.numel(), hidden, dtype=dtype, device=q.device)  # [N*K, H]
    gelu = ACTIVATIONS["gelu_pytorch_tanh"]
    for expert in flat.unique().tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        w_gate_up = gate_up[expert].float() * gate_up_scale[expert]
        gate, up = F.linear(x[pairs // top_k], w_gate_up).to(dtype).float().chunk(2, dim=-1)
        act = (gelu(gate).to(dtype).float() * up).to(dtype)
        act_q, act_scale = quantize_fp8_groups(act, ACT_GROUP)
        groups = act_scale.repeat_interleave(ACT_GROUP, dim=1)[:, : act.shape[1]]
        w_down = down[expert].float() * down_scale[expert]
        out = F.linear(act_q.float() * groups, w_down).to(dtype).float()
        pair_rows[pairs] = (out * weights.reshape(-1)[pairs, None]).to(dtype)
    return pair_rows.view(num_tokens, top_k, hidden).float().sum(1).to(dtype)
