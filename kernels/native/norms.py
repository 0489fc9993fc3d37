"""The native norms (`norms.c`): RMSNorm and a layer's norm tails (`add_rms_norm`,
`rms_norm_pair`, `close_layer`: 3 to 10 passes over the [tokens, hidden] activations each in
the twins) one row at a time; also bound for attention's per-head q/k/v norms and the router's
norm, where at an AR step's few rows `F.rms_norm`'s dispatches cost more than the arithmetic.
bf16 operands run the `_bf16` kernels (fp32 arithmetic, rounded to bf16 where the bf16 twins
round); other dtypes and autograd take the twins."""

from __future__ import annotations

from collections.abc import Callable

import torch

import kernels.native.bf16 as bf16
import kernels.reference as reference
from kernels.native.args import CloseLayerArgs, NormArgs, NormPairArgs
from kernels.native.build import loaded
from kernels.native.threads import addresses, norm_min_rows, norm_rows, ptr, split_rows, takes


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.rms_norm_fused`, natively (fp32 or bf16 CPU; the twin otherwise)."""
    if not _native(x, weight) or x.numel() == 0:
        return reference.rms_norm_fused(x, weight, eps)
    return _norm(x, weight, None, eps)


def _native(*tensors: torch.Tensor | None) -> bool:
    """Whether the native norms take these operands: all fp32, or all bf16 (`bf16.takes`)."""
    return takes(*tensors) or bf16.takes(*tensors)


def _kernel(lib: object, name: str, x: torch.Tensor) -> Callable[..., object]:
    """Kernel `name` of `lib` for x's dtype (`name` or its `_bf16` twin)."""
    kernel: Callable[..., object] = getattr(
        lib, f"{name}_bf16" if x.dtype is torch.bfloat16 else name
    )
    return kernel


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
    kernel = _kernel(lib, "canvas_rms_norm", x)
    split_rows("norms", kernel, args, norm_rows(x), norm_min_rows(hidden))
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`reference.add_rms_norm`, natively."""
    same = residual.shape == x.shape
    if not same or not _native(residual, x, weight) or x.numel() == 0:
        return reference.add_rms_norm(residual, x, weight, eps)
    return _norm(x, weight, residual, eps)


def rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm_pair`, natively."""
    if not _native(x, weight_a, weight_b) or x.numel() == 0:
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
    kernel = _kernel(lib, "canvas_rms_norm_pair", x)
    split_rows("norms", kernel, args, norm_rows(x), norm_min_rows(hidden))
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
    if not shaped or not _native(*operands) or dense.numel() == 0:
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
    kernel = _kernel(lib, "canvas_close_layer", dense)
    split_rows("norms", kernel, args, rows, norm_min_rows(hidden))
    return out
