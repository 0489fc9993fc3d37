"""The native norms (`norms.c`): RMSNorm and a layer's norm tails (`add_rms_norm`,
`rms_norm_pair`, `close_layer`: 3 to 10 passes over the [tokens, hidden] activations each in
the twins) one row at a time; also bound for attention's per-head q/k/v norms and the router's
norm, where at an AR step's few rows `F.rms_norm`'s dispatches cost more than the arithmetic.
Non-fp32 operands and autograd take the twins."""

from __future__ import annotations

import torch

import kernels.reference as reference
from kernels.native.args import CloseLayerArgs, NormArgs, NormPairArgs
from kernels.native.build import loaded
from kernels.native.threads import addresses, norm_min_rows, norm_rows, ptr, split_rows, takes


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.rms_norm_fused`, natively (fp32 CPU; the twin otherwise)."""
    if not takes(x, weight) or x.numel() == 0:
        return reference.rms_norm_fused(x, weight, eps)
    return _norm(x, weight, None, eps)


def _norm(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor:
    lib = loaded("norms")
    x = x.contiguous()
    hidden = x.shape[-1]
    w = None if weight is None else weight.contiguous()
    res = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    args = NormArgs(x=ptr(x), w=ptr(w), residual=ptr(res), out=out.data_ptr(), h=hidden, eps=eps)
    split_rows("norms", lib.canvas_rms_norm, args, norm_rows(x), norm_min_rows(hidden))
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`reference.add_rms_norm`, natively."""
    same = residual.shape == x.shape
    if not same or not takes(residual, x, weight) or x.numel() == 0:
        return reference.add_rms_norm(residual, x, weight, eps)
    return _norm(x, weight, residual, eps)


def rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm_pair`, natively."""
    if not takes(x, weight_a, weight_b) or x.numel() == 0:
        return reference.rms_norm_pair(x, weight_a, weight_b, eps)
    lib = loaded("norms")
    x = x.contiguous()
    hidden = x.shape[-1]
    wa, wb = weight_a.contiguous(), weight_b.contiguous()
    out_a, out_b = torch.empty_like(x), torch.empty_like(x)
    args = NormPairArgs(
        x=x.data_ptr(),
        wa=wa.data_ptr(),
        wb=wb.data_ptr(),
        out_a=out_a.data_ptr(),
        out_b=out_b.data_ptr(),
        h=hidden,
        eps=eps,
    )
    split_rows("norms", lib.canvas_rms_norm_pair, args, norm_rows(x), norm_min_rows(hidden))
    return out_a, out_b


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
    """`reference.close_layer`, natively (scale: one value, or one per row)."""
    rows = norm_rows(dense)
    operands = (dense, moe, residual, dense_weight, moe_weight, weight, scale)
    shaped = dense.shape == moe.shape == residual.shape and scale.numel() in (1, rows)
    if not shaped or not takes(*operands) or dense.numel() == 0:
        return reference.close_layer(dense, moe, residual, dense_weight, moe_weight, weight,
                                     scale, eps)  # fmt: skip
    lib = loaded("norms")
    d, m, r, wd, wm, w, s = (t.contiguous() for t in operands)
    hidden = dense.shape[-1]
    out = torch.empty_like(d)
    args = CloseLayerArgs(
        **addresses(dense=d, moe=m, residual=r, wd=wd, wm=wm, w=w, scale=s),
        scale_per_row=int(scale.numel() == rows and rows > 1),
        out=out.data_ptr(),
        h=hidden,
        eps=eps,
    )
    split_rows("norms", lib.canvas_close_layer, args, rows, norm_min_rows(hidden))
    return out
