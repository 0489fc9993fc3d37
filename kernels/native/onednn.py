"""bf16 dense projections on oneDNN with the weight reordered once per binding: what
`kernels.native.bf16` runs where it would otherwise call the twin (`reference.linear`, whose
bf16 GEMM is oneDNN's, reordering the plain weight into oneDNN's blocked layout on every call).

`reorder` is `torch.ops.mkldnn._reorder_linear_weight` (an opaque oneDNN tensor of the same
shape and dtype, laid out for oneDNN's default batch hint); `linear` is
`torch.ops.mkldnn._linear_pointwise` with no bias and no fused op, which takes that layout as it
is (no reorder of the weight or the input per call) and returns x's dtype: the same sums as the
twin's, its values within a bf16 ulp (a row's value may differ by one with the batch it shares, as
the twin's: fast numerics; exact numerics never bind these kernels). Whether a binding
uses them is decided once, when the binding is made (`decide`, logged at debug): a torch
without oneDNN or without the two ops, or a CPU whose oneDNN refuses bf16 or does not give
F.linear's values on a probe, keeps the twin. `held_bytes` is what those copies take, for the
memory plan (`engine.device.memory`): they are made at each weight's first use, after the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# torch.ops.mkldnn's names of the reorder and the prepacked product.
OPS = ("_reorder_linear_weight", "_linear_pointwise")
PROBE_SHAPE = (3, 37, 21)  # rows, inputs, outputs: off every block size


def unavailable() -> str | None:
    """Why bf16 weights cannot be reordered once for oneDNN here, or None where they can: a
    probe product on a reordered weight must match F.linear within a bf16 ulp."""
    if not torch.backends.mkldnn.is_available():
        return "torch has no oneDNN"
    missing = [name for name in OPS if not hasattr(torch.ops.mkldnn, name)]
    if missing:
        return f"torch.ops.mkldnn lacks {', '.join(missing)}"
    rows, k, n = PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).bfloat16()
    weight = torch.randn(n, k, generator=g).bfloat16()
    try:
        with torch.no_grad():
            got = linear(x, reorder(weight))
    except RuntimeError as err:  # oneDNN without a bf16 path on this CPU
        return f"oneDNN refused a bf16 weight: {err}"
    want = F.linear(x, weight)
    if got.dtype != torch.bfloat16 or not torch.allclose(got, want, rtol=2**-7, atol=1e-2):
        return "oneDNN's product on a reordered weight differs from F.linear's"
    return None


def decide() -> bool:
    """Whether a binding made now runs its bf16 dense projections on weights reordered once
    (`unavailable` is None), logged at debug."""
    why = unavailable()
    if why is None:
        logger.debug("bf16 dense projections: oneDNN on weights reordered once per binding")
    else:
        logger.debug("bf16 dense projections: the twin (oneDNN reorders per call): %s", why)
    return why is None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes x [..., K] and weight [N, K]: both bf16, weight 2-D and not
    empty, K matching."""
    return (
        x.dtype is torch.bfloat16
        and weight.dtype is torch.bfloat16
        and weight.dim() == 2
        and weight.numel() > 0
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
    )


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 as an opaque oneDNN tensor in oneDNN's layout for its products (a
    copy: the weight itself is untouched)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, reordered: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight^T for `reorder(weight)`, [..., N] in x's dtype (fp32 sums): one
    oneDNN product over all rows, no bias."""
    k, n = x.shape[-1], reordered.shape[0]
    flat = x.reshape(-1, k)
    out = torch.ops.mkldnn._linear_pointwise(flat, reordered, None, "none", [], "")
    return out.view(*x.shape[:-1], n)


def held_bytes(weights: Iterable[torch.Tensor]) -> int:
    """The bytes a native bf16 binding holds beside `weights` (a model's dense projections)
    once each has run: one copy of each bf16 2-D weight, reordered for oneDNN (`reorder`: the
    same shape and dtype) or, on a CPU without AMX, packed for `bf16.c`'s tiles (K padded to
    even). At most that: a torch without oneDNN keeps the twin, with no copy, for the weights
    the tiles do not take."""
    return sum(
        w.shape[0] * (w.shape[1] + w.shape[1] % 2) * w.element_size()
        for w in weights
        if w.dtype is torch.bfloat16 and w.dim() == 2
    )
