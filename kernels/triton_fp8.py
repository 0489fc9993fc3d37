"""FP8 dense projections on Hopper. Twins: `reference.quantize_fp8_rows`,
`reference.fp8_linear`, `reference.fp8_linear_rows` (same signatures).

- `quantize_fp8_rows`: activations to FP8 E4M3 with one fp32 scale per row (token), computed
  on the fly (amax / 448, compressed-tensors' dynamic per-token scheme): one program per row,
  two passes over it (the amax, then the scaled cast).
- `fp8_linear`: the rows quantized, then `torch._scaled_mm` with row-wise scales (per token on
  the activations, per output channel on the weight) and fp32 accumulation, out in the
  activations' dtype: FP8 x FP8 on the tensor cores, half the weight bytes of bf16. Where the
  operands do not fit `_scaled_mm`'s row-wise contract (bf16 out, both dims multiples of 16,
  the weight's rows packed, at least one row) the call falls back to the twin; which device
  runs this launcher at all is chosen once, at bind (`scaled_mm_rowwise`: sm_90 with a torch
  that has it).
- `fp8_linear_rows`: `_scaled_mm` over rows already quantized per token (a norm or the GeGLU
  product emitted them: `kernels.triton_fp8_emit`), no quantizer launch; the twin where the
  operands do not fit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference_fp8 import FP8_MAX, SCALE_FLOOR
from kernels.reference_fp8 import fp8_linear as twin_fp8_linear
from kernels.reference_fp8 import fp8_linear_rows as twin_fp8_linear_rows
from kernels.support import expect, interpreting

_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
# torch's first release with row-wise scales in `_scaled_mm` (fp32 [M, 1] and [1, N]).
ROWWISE_TORCH = "2.5"


def scaled_mm_rowwise() -> bool:
    """Whether this process's CUDA device runs `torch._scaled_mm` with row-wise scales: an
    sm_90 (Hopper) device and a torch from `ROWWISE_TORCH` on. Elsewhere (the CPU, sm_80, an
    older torch) the backends bind the dequantizing twin."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.torch_version.TorchVersion(torch.__version__) < ROWWISE_TORCH:
        return False
    return tuple(torch.cuda.get_device_capability()) == (9, 0)


def e4m3_kernels() -> bool:
    """Whether Triton's FP8 E4M3 kernels (this module's quantizer, `triton_moe.fp8_moe`) run
    here: everywhere but a CUDA device before sm_89 (Triton has no E4M3 for sm_80, whose
    engines bind the dequantizing twins). The CPU runs them only under the interpreter."""
    return not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) >= (8, 9)


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest even on E4M3's grid, in fp32: the cast after it is
    exact wherever it runs (the interpreter's own cast rounds ties up and drops the carry of a
    mantissa that rounds over)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    # Below 2**-6 E4M3 is subnormal, in steps of 2**-9: 24576's fp32 ulp.
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def quantize_tile(h, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr):
    """Rows h [BLOCK_M, BLOCK_D] (fp32, zeros past the row) quantized per row as
    `quantize_fp8_rows` does: (values on E4M3's grid in fp32 [BLOCK_M, BLOCK_D], scales
    [BLOCK_M])."""
    scale = tl.maximum(tl.max(tl.abs(h), 1), FLOOR) / FP8_MAX
    q = h / scale[:, None]
    return round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)), scale


@triton.jit(do_not_specialize=["num_cols"])
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, num_cols, sx_n, sq_n, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
    FLOOR: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * sx_n, q_ptr + row * sq_n
    amax = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, num_cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + c, mask=c < num_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0), FLOOR) / FP8_MAX
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, num_cols, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + c, mask=c < num_cols, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX))
        tl.store(q_row + c, q.to(q_ptr.dtype.element_ty), mask=c < num_cols)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.quantize_fp8_rows`: x [M, K] to (FP8 E4M3 [M, K], fp32 scales [M, 1])."""
    num_rows, num_cols = x.shape
    expect(x, "x", (num_rows, num_cols), _ACTIVATIONS, x.device)
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block = min(4096 if interpreting() else 1024, triton.next_power_of_2(num_cols))
    _quantize_rows_kernel[(num_rows,)](
        x, q, scale, num_cols, x.stride(0), q.stride(0), BLOCK=block, FP8_MAX=FP8_MAX,
        FLOOR=SCALE_FLOOR, num_warps=4,
    )  # fmt: skip
    return q, scale


def _fits_scaled_mm(
    rows: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor
) -> bool:
    """Whether `_scaled_mm`'s row-wise contract holds (the module docstring)."""
    out_dim, in_dim = weight.shape
    return (
        rows.numel() > 0
        and dtype == torch.bfloat16
        and in_dim % 16 == 0
        and out_dim % 16 == 0
        and weight.dtype == torch.float8_e4m3fn
        and weight.stride() == (in_dim, 1)
        and scale.dtype == torch.float32
        and scale.numel() == out_dim
    )


def _scaled_mm(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """q [rows, In] FP8 (scales [rows, 1]) @ (weight * scale)^T: [rows, Out] in `dtype`."""
    return torch._scaled_mm(
        q, weight.t(), scale_a=q_scale, scale_b=scale.reshape(1, -1), out_dtype=dtype
    )


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, segments: list[int]
) -> torch.Tensor:
    """See `reference.fp8_linear`: x [..., N, In] @ (weight * scale)[Out, In]^T, out in x's
    dtype, through `torch._scaled_mm` on x's rows quantized per token (the twin where the
    operands do not fit its row-wise contract; see the module docstring)."""
    if not _fits_scaled_mm(x, x.dtype, weight, scale):
        return twin_fp8_linear(x, weight, scale, segments)
    out_dim, in_dim = weight.shape
    q, q_scale = quantize_fp8_rows(x.reshape(-1, in_dim))
    out = _scaled_mm(q, q_scale, weight, scale, x.dtype)  # [rows, Out]
    return out.reshape(*x.shape[:-1], out_dim)


def fp8_linear_rows(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """See `reference.fp8_linear_rows`: FP8 rows q [..., N, In] with per-token scales
    [..., N, 1] through `torch._scaled_mm` (the twin where the operands do not fit)."""
    out_dim, in_dim = weight.shape
    rows = q.reshape(-1, in_dim)
    fits = q.dtype == torch.float8_e4m3fn and rows.stride(-1) == 1
    fits = fits and q_scale.dtype == torch.float32 and q_scale.numel() == len(rows)
    if not (fits and _fits_scaled_mm(rows, dtype, weight, scale)):
        return twin_fp8_linear_rows(q, q_scale, weight, scale, dtype)
    q_scale = q_scale.reshape(-1, 1)
    return _scaled_mm(rows, q_scale, weight, scale, dtype).reshape(*q.shape[:-1], out_dim)


KERNELS = (quantize_fp8_rows, fp8_linear, fp8_linear_rows)
