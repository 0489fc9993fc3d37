"""The RMSNorm twins (`kernels.reference` re-exports them): the reference-exact norm and the
fast numerics' fused one, apart so that the layer twins (`kernels.reference_layer`) can use
them without importing the module that re-exports the layer twins."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm in fp32: x * (mean(x^2) + eps)^-0.5 * weight (weight used as is)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.type_as(x)


# Up to this many elements a CPU norm is one `F.rms_norm` call (one dispatch, for the few rows
# of an AR step); beyond it `F.rms_norm`'s CPU loop is slower than `rms_norm_fused`'s three
# vectorised passes. Both give the same bits (tested), so the switch
# keeps a row's value independent of its batch.
SMALL_NORM = 1 << 15


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` in fast numerics, for fp32 operands (other dtypes take the twin): on the CPU
    the mean square as one dot product per row, then two in-place scalings (3 passes over x
    instead of the twin's 6), or for a few rows one
    `F.rms_norm` call; elsewhere `F.rms_norm`. Either may differ from the twin in the last
    bit."""
    if x.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32):
        return rms_norm(x, weight, eps)
    if x.device.type != "cpu" or x.numel() <= SMALL_NORM:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    inv = torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_().unsqueeze(-1)
    out = x * inv
    return out if weight is None else out.mul_(weight)
