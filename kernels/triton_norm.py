"""The forward's memory-bound passes, in Triton: one read and one write each. Twins:
`reference.rms_norm` and `reference.softcap` (same signatures, same contracts).

- `rms_norm`: Gemma's RMSNorm over the last dimension (fp32 math inside, the weight used as is,
  or none: DiffusionGemma's v_norm). Any leading shape: the hidden states [1, N, H] as well as
  the per-head q/k/v norms over [1, N, heads, D]. Each program normalises BLOCK_M rows of
  BLOCK_D (the next power of two of the row length) columns, masked; the twin's six passes
  (`float`, `pow`, `mean`, two products, `type_as`) become one.
- `softcap`: the LM head's cap * tanh(logits / cap) from the GEMM's output (bf16) to fp32
  logits in one pass, where the twin converts, then divides, takes tanh and multiplies in place
  (four passes over [N, vocab], the step's largest tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import expect, interpreting

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, num_rows, dim, stride_x, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, 1) / dim + eps)  # [BLOCK_M]
    h = h * inv[:, None]
    if HAS_WEIGHT:
        h = h * tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * dim + cols[None, :]
    tl.store(out, h.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """See `reference.rms_norm`: x [..., D] of any float dtype, weight [D] or None. Returns a
    contiguous tensor of x's shape and dtype. Rows are addressed through one stride (a copy is
    made only when x's leading dimensions cannot be flattened into one)."""
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)  # a view for the engine's layouts
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    num_rows = flat.shape[0]
    expect(flat, "x", (num_rows, dim), _FLOATS, x.device)
    if weight is not None:
        expect(weight, "weight", (dim,), _FLOATS, x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0 or dim == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    # ~4K elements per program on a GPU (a row of the hidden states, a few heads); the
    # interpreter pays per program, so it takes many rows at once.
    elements = 1 << 16 if interpreting() else 4096
    block_m = max(1, min(elements // block_d, triton.next_power_of_2(num_rows)))
    _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
        flat, flat if weight is None else weight, out, num_rows, dim, flat.stride(0), eps,
        HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=8 if block_d >= 2048 else 4,
    )  # fmt: skip
    return out


@triton.jit
def _softcap_kernel(x_ptr, out_ptr, numel, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) / cap
    # tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|) in (0, 1]: no overflow.
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    tl.store(out_ptr + offs, tl.where(y < 0, -t, t) * cap, mask=mask)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """See `reference.softcap`: the head's output [..., V] (any float dtype, contiguous) to fp32
    logits capped at +-cap (without a cap: converted only). Returns a new fp32 tensor."""
    if cap is None:
        return logits.float()
    assert logits.is_contiguous(), "logits: the GEMM's contiguous output"
    assert logits.dtype in _FLOATS, f"logits: dtype {logits.dtype}, expected one of {_FLOATS}"
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    numel = logits.numel()
    if numel:
        block = 1 << 16 if interpreting() else 2048
        _softcap_kernel[(triton.cdiv(numel, block),)](logits, out, numel, cap, BLOCK=block)
    return out


KERNELS = (rms_norm, softcap)
