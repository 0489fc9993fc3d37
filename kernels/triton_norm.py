"""The forward's memory-bound passes, in Triton: one read and one write each. Twins:
`reference.rms_norm`, `reference.qkv_norm_rope` and `reference.softcap` (same signatures, same
contracts).

- `rms_norm`: Gemma's RMSNorm over the last dimension (fp32 math inside, the weight used as is,
  or none: DiffusionGemma's v_norm). Any leading shape: the hidden states [1, N, H] as well as
  the per-head q/k/v norms over [1, N, heads, D]. Each program normalises BLOCK_M rows of
  BLOCK_D (the next power of two of the row length) columns, masked; the twin's six passes
  (`float`, `pow`, `mean`, two products, `type_as`) become one.
- `qkv_norm_rope`: attention's per-head q and k norms (weighted) and v norm (unweighted), then
  RoPE on q and k, in one launch: a program per (block of tokens, head), q's heads then k's
  then v's, each head read once and written once (the twin's norms and half-width RoPE
  products are ~15 passes, most of them small launches).
- `softcap`: the LM head's cap * tanh(logits / cap) from the GEMM's output (bf16) to fp32
  logits in one pass, where the twin converts, then divides, takes tanh and multiplies in place
  (four passes over [N, vocab], the step's largest tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.support import expect, interpreting

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rows_per_program(row_elements: int, num_rows: int) -> int:
    """BLOCK_M of a row-wise kernel whose rows take `row_elements` lanes each: ~4K elements
    per program on a GPU (a row of the hidden states, a few heads), whatever the step's row
    count, so that a new number of rows never compiles a new kernel (the tail is masked). The
    interpreter compiles nothing and pays per program and per lane: it takes many rows at
    once, but no more than there are."""
    if interpreting():
        return max(1, min((1 << 16) // row_elements, triton.next_power_of_2(num_rows)))
    return max(1, 4096 // row_elements)


@triton.jit(do_not_specialize=["num_rows"])
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
    block_m = rows_per_program(block_d, num_rows)
    _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
        flat, flat if weight is None else weight, out, num_rows, dim, flat.stride(0), eps,
        HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=8 if block_d >= 2048 else 4,
    )  # fmt: skip
    return out


@triton.jit
def _rounded(x, dt: tl.constexpr):
    return x.to(dt).to(tl.float32)


@triton.jit(do_not_specialize=["num_tokens"])
def _qkv_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, vo_ptr,
    num_tokens, num_q_heads, num_kv_heads, dim, sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, sc_n, eps,
    BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Program (token block, head): heads [0, Hq) are q's, then Hkv of k, then Hkv of v. Each
    normalises BLOCK_N tokens of its head (fp32, rounded to the output dtype as the twin's
    `type_as`), then applies RoPE on the two halves with each product rounded on its own. One
    body for all three: v's weight loads as 1 and its cos, sin as 1, 0 (exact identities)."""
    head = tl.program_id(1)
    if head < num_q_heads:
        x_ptr, w_ptr, stride_x = q_ptr + head * sq_h, qw_ptr, sq_n
        out_ptr, stride_out = qo_ptr + head * dim, num_q_heads * dim
    elif head < num_q_heads + num_kv_heads:
        head -= num_q_heads
        x_ptr, w_ptr, stride_x = k_ptr + head * sk_h, kw_ptr, sk_n
        out_ptr, stride_out = ko_ptr + head * dim, num_kv_heads * dim
    else:
        head -= num_q_heads + num_kv_heads
        x_ptr, w_ptr, stride_x = v_ptr + head * sv_h, kw_ptr, sv_n
        out_ptr, stride_out = vo_ptr + head * dim, num_kv_heads * dim
    half = dim // 2
    # Columns of the weight and the tables to read: all for q and k, none for v.
    rotated = tl.where(tl.program_id(1) < num_q_heads + num_kv_heads, half, 0)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < num_tokens)[:, None] & (cols < half)[None, :]
    x_row = x_ptr + rows[:, None] * stride_x + cols[None, :]
    h1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    h2 = tl.load(x_row + half, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt_rn((tl.sum(h1 * h1, 1) + tl.sum(h2 * h2, 1)) / dim + eps)
    w_mask = cols < rotated
    w1 = tl.load(w_ptr + cols, mask=w_mask, other=1.0).to(tl.float32)
    w2 = tl.load(w_ptr + half + cols, mask=w_mask, other=1.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    h1 = _rounded(h1 * inv[:, None] * w1[None, :], dt)
    h2 = _rounded(h2 * inv[:, None] * w2[None, :], dt)
    table = rows[:, None] * sc_n + cols[None, :]
    t_mask = mask & w_mask[None, :]
    c = tl.load(cos_ptr + table, mask=t_mask, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=t_mask, other=0.0).to(tl.float32)
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, (_rounded(h1 * c, dt) - _rounded(h2 * s, dt)).to(dt), mask=mask)
    tl.store(out + half, (_rounded(h2 * c, dt) + _rounded(h1 * s, dt)).to(dt), mask=mask)


def qkv_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.qkv_norm_rope`: q [N, Hq, D], k and v [N, Hkv, D] (any token and head
    strides, v may be k), weights [D], cos and sin [N, D] in q's dtype (only their first halves
    are read). Returns contiguous (q, k, v) in one launch."""
    num_tokens, num_q_heads, dim = q.shape
    num_kv_heads, dev = k.shape[1], q.device
    assert dim % 2 == 0, f"head_dim must be even for RoPE, got {dim}"
    for name, t, heads in (("q", q, num_q_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads)):
        expect(t, name, (num_tokens, heads, dim), (q.dtype,), dev)
    expect(q_weight, "q_weight", (dim,), _FLOATS, dev)
    expect(k_weight, "k_weight", (dim,), (q_weight.dtype,), dev)
    for name, t in (("cos", cos), ("sin", sin)):
        expect(t, name, (num_tokens, dim), (q.dtype,), dev)
    assert cos.stride() == sin.stride(), "cos and sin: one layout"
    outs = tuple(torch.empty(t.shape, dtype=t.dtype, device=dev) for t in (q, k, v))
    if num_tokens == 0:
        return outs  # type: ignore[return-value]
    block_half = triton.next_power_of_2(dim // 2)
    block_n = rows_per_program(2 * block_half, num_tokens)  # 16 tokens of a 256-wide head
    grid = (triton.cdiv(num_tokens, block_n), num_q_heads + 2 * num_kv_heads)
    _qkv_norm_rope_kernel[grid](
        q, k, v, q_weight, k_weight, cos, sin, *outs,
        num_tokens, num_q_heads, num_kv_heads, dim, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), cos.stride(0), eps,
        BLOCK_N=block_n, BLOCK_HALF=block_half, num_warps=4,
    )  # fmt: skip
    return outs  # type: ignore[return-value]


@triton.jit(do_not_specialize=["numel"])
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


KERNELS = (rms_norm, qkv_norm_rope, softcap)
