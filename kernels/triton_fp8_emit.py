"""The norms and the GeGLU product that feed FP8 projections, emitting FP8 E4M3 rows with one
fp32 scale per token in the same pass (sm_90's FP8 path: `KernelSet.with_fp8_rows`). Twins:
`reference.rms_norm_fp8`, `reference.rms_norm_pair_fp8`, `reference.gated_act_fp8` (same
signatures).

Each program holds whole rows ([BLOCK_M, BLOCK_D], BLOCK_D the next power of two of the row
length, as `triton_norm.rms_norm`), so the row's amax comes free after the norm: the value is
computed as the bf16 kernel computes it (`triton_norm.rms_norm`, `triton_layer.rms_norm_pair`,
`triton_layer.gated_act`), rounded to the input dtype as they store it, then quantized as
`triton_fp8.quantize_fp8_rows` quantizes (amax / 448, nearest even on E4M3's grid). So the
output is bit for bit the bf16 kernel followed by the quantizer, one launch and one write of
one byte an element instead of two launches, a bf16 write and two bf16 reads.

- `rms_norm_fp8`: the input norm before attention's q/k/v projections (quantized once for
  the three) and the self-conditioning block's pre-norm before its gate/up.
- `rms_norm_pair_fp8`: the dense MLP's and the experts' pre-norms from one read of x, both
  quantized (gate/up's input, and the FP8 x FP8 experts', `kernels.triton_fp8_moe`).
- `gated_act_fp8`: act(gate) * up, quantized: the down projection's input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference_fp8 import FP8_MAX, SCALE_FLOOR
from kernels.support import expect
from kernels.triton_fp8 import quantize_tile
from kernels.triton_layer import GATED, activate
from kernels.triton_norm import rows_per_program

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn


@triton.jit(do_not_specialize=["num_rows"])
def _norm_fp8_kernel(
    x_ptr, wa_ptr, wb_ptr, qa_ptr, sa_ptr, qb_ptr, sb_ptr, num_rows, dim, stride_x, eps,
    HAS_WEIGHT: tl.constexpr, PAIR: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    """rms_norm(x, wa) quantized per row into (qa, sa); PAIR: rms_norm(x, wb) into (qb, sb)
    too. x rows at stride_x; outputs contiguous [num_rows, dim]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    r_mask = rows < num_rows
    mask = r_mask[:, None] & (cols < dim)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dt = x_ptr.dtype.element_ty
    h = x.to(tl.float32)
    h = h * (1.0 / tl.sqrt_rn(tl.sum(h * h, 1) / dim + eps))[:, None]
    offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    a = h
    if HAS_WEIGHT:
        a = h * tl.load(wa_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)[None, :]
    a = a.to(dt).to(tl.float32)  # the bf16 kernel's stored value
    q, scale = quantize_tile(a, FP8_MAX, FLOOR)
    tl.store(qa_ptr + offs, q.to(qa_ptr.dtype.element_ty), mask=mask)
    tl.store(sa_ptr + rows, scale, mask=r_mask)
    if PAIR:
        b = h * tl.load(wb_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)[None, :]
        q, scale = quantize_tile(b.to(dt).to(tl.float32), FP8_MAX, FLOOR)
        tl.store(qb_ptr + offs, q.to(qb_ptr.dtype.element_ty), mask=mask)
        tl.store(sb_ptr + rows, scale, mask=r_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_act_fp8_kernel(
    g_ptr, u_ptr, q_ptr, s_ptr, num_rows, dim, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    """act(gate) * up over contiguous rows [num_rows, dim], each product rounded to the inputs'
    dtype as `triton_layer.gated_act` stores it, quantized per row into (q, s)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    r_mask = rows < num_rows
    mask = r_mask[:, None] & (cols < dim)[None, :]
    offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    dt = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = activate(g, ACT).to(dt).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_tile((act * u).to(dt).to(tl.float32), FP8_MAX, FLOOR)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, scale, mask=r_mask)


def _outputs(x: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` pairs of (FP8 values of x's shape, fp32 scales [..., 1]), contiguous."""
    scale_shape = (*x.shape[:-1], 1)
    outs: list[torch.Tensor] = []
    for _ in range(count):
        outs.append(torch.empty(x.shape, dtype=FP8, device=x.device))
        outs.append(torch.empty(scale_shape, dtype=torch.float32, device=x.device))
    return outs


def _grid(num_rows: int, dim: int) -> tuple[int, int, int]:
    """(programs, BLOCK_M, BLOCK_D) of a whole-row kernel."""
    block_d = triton.next_power_of_2(dim)
    block_m = rows_per_program(block_d, num_rows)
    return triton.cdiv(num_rows, block_m), block_m, block_d


def _norm(
    x: torch.Tensor, weight_a: torch.Tensor | None, weight_b: torch.Tensor | None, eps: float
) -> list[torch.Tensor]:
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)  # a view for the engine's layouts
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    num_rows = flat.shape[0]
    expect(flat, "x", (num_rows, dim), _FLOATS, x.device)
    for name, w in (("weight_a", weight_a), ("weight_b", weight_b)):
        if w is not None:
            expect(w, name, (dim,), _FLOATS, x.device)
    outs = _outputs(x, 1 if weight_b is None else 2)
    if num_rows == 0 or dim == 0:
        return outs
    qb, sb = outs[2:] if weight_b is not None else outs
    programs, block_m, block_d = _grid(num_rows, dim)
    _norm_fp8_kernel[(programs,)](
        flat, flat if weight_a is None else weight_a, flat if weight_b is None else weight_b,
        outs[0], outs[1], qb, sb, num_rows, dim, flat.stride(0), eps,
        HAS_WEIGHT=weight_a is not None, PAIR=weight_b is not None, BLOCK_M=block_m,
        BLOCK_D=block_d, FP8_MAX=FP8_MAX, FLOOR=SCALE_FLOOR,
        num_warps=8 if block_d >= 2048 else 4,
    )  # fmt: skip
    return outs


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.rms_norm_fp8`: x [..., D] (rows through one stride, as `rms_norm`),
    weight [D] or None. Returns (FP8 [..., D], fp32 scales [..., 1]), contiguous."""
    q, scale = _norm(x, weight, None, eps)
    return q, scale


def rms_norm_pair_fp8(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.rms_norm_pair_fp8`: x [..., D]; both norms quantized from one read."""
    qa, sa, qb, sb = _norm(x, weight_a, weight_b, eps)
    return qa, sa, qb, sb


def gated_act_fp8(
    gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.gated_act_fp8`: gate and up contiguous [..., I] of one shape and dtype.
    Returns (FP8 [..., I], fp32 scales [..., 1])."""
    assert activation in GATED, f"activation {activation!r}: one of {sorted(GATED)}"
    dim = gate.shape[-1]
    expect(gate.reshape(-1, dim), "gate", (None, dim), _FLOATS, gate.device)
    expect(up, "up", tuple(gate.shape), (gate.dtype,), gate.device)
    assert gate.is_contiguous() and up.is_contiguous(), "gate, up: must be contiguous"
    q, scale = _outputs(gate, 1)
    num_rows = gate.numel() // max(dim, 1)
    if num_rows and dim:
        programs, block_m, block_d = _grid(num_rows, dim)
        _gated_act_fp8_kernel[(programs,)](
            gate, up, q, scale, num_rows, dim, ACT=GATED[activation], BLOCK_M=block_m,
            BLOCK_D=block_d, FP8_MAX=FP8_MAX, FLOOR=SCALE_FLOOR,
            num_warps=8 if block_d >= 2048 else 4,
        )  # fmt: skip
    return q, scale


KERNELS = (rms_norm_fp8, rms_norm_pair_fp8, gated_act_fp8)
