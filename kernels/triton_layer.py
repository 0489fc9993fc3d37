"""A layer's element-wise tails in Triton, one pass each (twins: `kernels.reference_layer`,
same signatures, same roundings: every intermediate the unfused layer stored is rounded to the
output dtype here too, so the values differ from the twins' only by fp32 reduction order).

- `add_rms_norm`: residual + rms_norm(x, w): reads x and residual, writes one output (the
  unfused norm then add: 2 launches, 5 passes).
- `rms_norm_pair`: two norms of one input with two weights: reads x once (2 launches, 4 passes).
- `close_layer`: DiffusionGemma's layer end: the dense and MoE branches' post-norms, their sum,
  the outer post-norm, the residual add and the layer scalar (6 launches, ~14 passes).
- `gated_act`: act(gate) * up, GeGLU or SwiGLU (2 launches, 5 passes).

A norm program handles BLOCK_M rows of BLOCK_D (the next power of two of the row length)
columns, as `triton_norm.rms_norm`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.support import expect, interpreting
from kernels.triton_norm import rows_per_program

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
GATED = {"gelu_pytorch_tanh": 0, "silu": 1}


@triton.jit
def _normed(h, w_ptr, cols, dim, eps, dt: tl.constexpr):
    """rms_norm of fp32 rows h [BLOCK_M, BLOCK_D] (zeros past dim) with weight w, as (h * inv)
    * w, rounded to dt and back to fp32 (the unfused norm's stored output)."""
    inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, 1) / dim + eps)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    return (h * inv[:, None] * w[None, :]).to(dt).to(tl.float32)


@triton.jit(do_not_specialize=["num_rows", "stride_s"])
def _norm_tail_kernel(
    a_ptr, b_ptr, r_ptr, wa_ptr, wb_ptr, w_ptr, s_ptr, out_ptr, out2_ptr,
    num_rows, dim, stride_s, eps,
    MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """MODE 0, add_rms_norm: out = r + norm(a, wa). MODE 1, rms_norm_pair: out = norm(a, wa),
    out2 = norm(a, wb). MODE 2, close_layer: out = (r + norm(norm(a, wa) + norm(b, wb), w)) *
    s[row * stride_s]. Rows are contiguous [num_rows, dim]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    dt = out_ptr.dtype.element_ty
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:
        tl.store(out_ptr + offs, _normed(a, wa_ptr, cols, dim, eps, dt).to(dt), mask=mask)
        tl.store(out2_ptr + offs, _normed(a, wb_ptr, cols, dim, eps, dt).to(dt), mask=mask)
    else:
        h = _normed(a, wa_ptr, cols, dim, eps, dt)
        if MODE == 2:
            b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            h = (h + _normed(b, wb_ptr, cols, dim, eps, dt)).to(dt).to(tl.float32)
            h = _normed(h, w_ptr, cols, dim, eps, dt)
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = (r + h).to(dt).to(tl.float32)
        if MODE == 2:
            s = tl.load(s_ptr + rows.to(tl.int64) * stride_s, mask=rows < num_rows, other=0.0)
            h = h * s.to(tl.float32)[:, None]
        tl.store(out_ptr + offs, h.to(dt), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    assert x.is_contiguous(), f"{name}: must be contiguous"
    return x.reshape(-1, x.shape[-1])


def _launch(
    mode: int, a: torch.Tensor, *tensors: torch.Tensor | None, eps: float, stride_s: int = 0
) -> None:
    """`_norm_tail_kernel` over a's rows [N, D]; `tensors`: its other pointers in order (None:
    unused by the mode)."""
    num_rows, dim = a.shape
    if num_rows == 0 or dim == 0:
        return
    block_d = triton.next_power_of_2(dim)
    block_m = rows_per_program(block_d, num_rows)
    ptrs = [a if t is None else t for t in tensors]
    _norm_tail_kernel[(triton.cdiv(num_rows, block_m),)](
        a, *ptrs, num_rows, dim, stride_s, eps,
        MODE=mode, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=8 if block_d >= 2048 else 4,
    )  # fmt: skip


def _check_rows(x: torch.Tensor, like: torch.Tensor, name: str) -> None:
    expect(x, name, tuple(like.shape), (like.dtype,), like.device)


def _check_weights(dim: int, like: torch.Tensor, **weights: torch.Tensor) -> None:
    for name, w in weights.items():
        expect(w, name, (dim,), _FLOATS, like.device)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """See `reference_layer.add_rms_norm`: x, residual contiguous [..., D] of one dtype."""
    expect(x.reshape(-1, x.shape[-1]), "x", (None, None), _FLOATS, x.device)
    _check_rows(residual, x, "residual")
    _check_weights(x.shape[-1], x, weight=weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = _rows(x, "x")
    _launch(0, rows, None, _rows(residual, "residual"), weight, None, None, None, _rows(out, ""),
            None, eps=eps)  # fmt: skip
    return out


def rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference_layer.rms_norm_pair`: x contiguous [..., D]."""
    expect(x.reshape(-1, x.shape[-1]), "x", (None, None), _FLOATS, x.device)
    _check_weights(x.shape[-1], x, weight_a=weight_a, weight_b=weight_b)
    out_a, out_b = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    _launch(1, _rows(x, "x"), None, None, weight_a, weight_b, None, None, _rows(out_a, ""),
            _rows(out_b, ""), eps=eps)  # fmt: skip
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
    """See `reference_layer.close_layer`: dense, moe, residual contiguous [..., D] of one dtype;
    scale of that dtype with one element, or one per row ([1, N, 1] for rows [1, N, D])."""
    expect(dense.reshape(-1, dense.shape[-1]), "dense", (None, None), _FLOATS, dense.device)
    _check_rows(moe, dense, "moe")
    _check_rows(residual, dense, "residual")
    dim = dense.shape[-1]
    _check_weights(dim, dense, dense_weight=dense_weight, moe_weight=moe_weight, weight=weight)
    rows = _rows(dense, "dense")
    assert scale.dtype == dense.dtype, f"scale: dtype {scale.dtype}, expected {dense.dtype}"
    count = scale.numel()
    assert count in (1, rows.shape[0]), f"scale: {count} values for {rows.shape[0]} rows"
    assert scale.device == dense.device, f"scale: on {scale.device}, expected {dense.device}"
    scale = scale.reshape(-1).contiguous()
    out = torch.empty(dense.shape, dtype=dense.dtype, device=dense.device)
    _launch(2, rows, _rows(moe, "moe"), _rows(residual, "residual"), dense_weight, moe_weight,
            weight, scale, _rows(out, ""), None, eps=eps,
            stride_s=0 if scale.numel() == 1 else 1)  # fmt: skip
    return out


@triton.jit
def activate(g, ACT: tl.constexpr):
    """The gated MLP's activation of fp32 g (`GATED`'s codes), in fp32."""
    if ACT == 0:  # gelu, tanh approximation: tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(y))
        t = (1.0 - e) / (1.0 + e)
        return 0.5 * g * (1.0 + tl.where(y < 0, -t, t))
    return g / (1.0 + tl.exp(-g))  # silu


@triton.jit(do_not_specialize=["numel"])
def _gated_act_kernel(g_ptr, u_ptr, out_ptr, numel, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = activate(g, ACT).to(dt).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (act * u).to(dt), mask=mask)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """See `reference_layer.gated_act`: gate and up contiguous, of one shape and dtype."""
    assert activation in GATED, f"activation {activation!r}: one of {sorted(GATED)}"
    expect(gate.reshape(-1), "gate", (None,), _FLOATS, gate.device)
    _check_rows(up, gate, "up")
    assert gate.is_contiguous() and up.is_contiguous(), "gate, up: must be contiguous"
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    numel = gate.numel()
    if numel:
        block = 1 << 16 if interpreting() else 2048
        _gated_act_kernel[(triton.cdiv(numel, block),)](
            gate, up, out, numel, ACT=GATED[activation], BLOCK=block
        )
    return out


KERNELS = (add_rms_norm, rms_norm_pair, close_layer, gated_act)
