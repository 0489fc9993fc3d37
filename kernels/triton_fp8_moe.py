"""The fused experts over FP8 activations and FP8 weights (FP8 x FP8 on the tensor cores: sm_90's
FP8 path, `KernelSet.with_fp8_rows`). Twin: `reference.fp8_moe_rows` (same signature).

The experts' input comes quantized per token from the norm before them
(`triton_fp8_emit.rms_norm_pair_fp8`); the launches are `triton_moe.fused_moe`'s (the pairs
aligned by expert, two grouped GEMMs, the slot sum), with FP8 operands in both GEMMs:

- gate/up: each tile's `tl.dot` takes the token's FP8 row and the expert's FP8 weights, fp32
  accumulation; the epilogue multiplies by the token's scale and the output channels' scales,
  rounds gate and up to the activations' dtype, takes gelu(gate) * up (rounded likewise) and
  quantizes it to FP8 per (row, block of `ACT_GROUP` columns): a program holds one block of a
  row, not the whole row, so the down GEMM's activations carry one scale per row and block.
- down: BLOCK_K is `ACT_GROUP`, so each K step's FP8 product is multiplied by its block's
  scale as it is accumulated; the epilogue applies the output channels' scales, rounds to the
  activations' dtype and multiplies by the routing weight.

Against the bf16 x FP8 kernel (`triton_moe.fp8_moe`): half the activation bytes and FP8's
tensor-core rate, for the activations' FP8 rounding (what `_scaled_mm` does to the dense
projections). Every pair's value is computed by one program over a fixed K order: batch
invariant, as `fused_moe`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference_fp8 import ACT_GROUP, FP8_MAX, SCALE_FLOOR
from kernels.support import expect
from kernels.triton_fp8 import quantize_tile
from kernels.triton_moe import align_pairs, expert_block_m, gelu_tanh, slot_sum

FP8 = torch.float8_e4m3fn
_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_expert_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, os_ptr, weights_ptr, pairs_ptr, block_expert_ptr,
    num_pairs, num_experts, k_dim, n_dim, sx_n, sw_e, sw_o, ss_e, ss_o, so_n, sr_n, sr_k,
    TOP_K: tl.constexpr, GEGLU: tl.constexpr, DT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    """One expert block x one column block of x @ W[expert]^T, x and W in FP8. GEGLU (W =
    gate_up, x by token = pair // TOP_K with one scale per token at xs, contiguous): out = FP8
    of gelu(gate) * up in padded-row order, its scale per (row, column block) at os, [rows,
    cdiv(n_dim, BLOCK_N)]. Else (W = down, x the GEGLU output in padded-row order, xs its block
    scales [rows, cdiv(k_dim, BLOCK_K)], BLOCK_K = their block): out = the product times the
    routing weight, in DT, by pair. DT: the activations' dtype, to which each GEMM's output is
    rounded."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    x_rows = (pair // TOP_K if GEGLU else rows).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < n_dim
    w_base = w_ptr + expert.to(tl.int64) * sw_e
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < k_dim
        x_mask = valid[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + x_rows[:, None] * sx_n + kk[None, :], mask=x_mask, other=0.0)
        w_mask = k_mask[:, None] & c_mask[None, :]
        w = tl.load(w_base + cols[None, :] * sw_o + kk[:, None], mask=w_mask, other=0.0)
        if GEGLU:
            acc = tl.dot(x, w, acc)
            w_up = tl.load(
                w_base + (cols + n_dim)[None, :] * sw_o + kk[:, None], mask=w_mask, other=0.0
            )
            acc_up = tl.dot(x, w_up, acc_up)
        else:  # the activations' scale of this block of K
            xs_rows = xs_ptr + x_rows * tl.cdiv(k_dim, BLOCK_K)
            block_scale = tl.load(xs_rows + k0 // BLOCK_K, mask=valid, other=0.0)
            acc += tl.dot(x, w) * block_scale[:, None]
    s_base = ws_ptr + expert.to(tl.int64) * ss_e
    acc *= tl.load(s_base + cols * ss_o, mask=c_mask, other=0.0)[None, :]
    mask = valid[:, None] & c_mask[None, :]
    if GEGLU:
        token_scale = tl.load(xs_ptr + x_rows, mask=valid, other=0.0)[:, None]
        acc = (acc * token_scale).to(DT).to(tl.float32)
        up_scale = tl.load(s_base + (cols + n_dim) * ss_o, mask=c_mask, other=0.0)[None, :]
        up = (acc_up * up_scale * token_scale).to(DT).to(tl.float32)
        h = gelu_tanh(acc).to(DT).to(tl.float32) * up
        h = tl.where(mask, h.to(DT).to(tl.float32), 0.0)
        q, scale = quantize_tile(h, FP8_MAX, FLOOR)
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * so_n + cols[None, :]
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=mask)
        os_rows = os_ptr + rows.to(tl.int64) * tl.cdiv(n_dim, BLOCK_N)
        tl.store(os_rows + pid_n, scale, mask=valid)
    else:
        token, slot = pair // TOP_K, pair % TOP_K
        acc = acc.to(DT).to(tl.float32)
        acc *= tl.load(weights_ptr + token * sr_n + slot * sr_k, mask=valid, other=0.0)[:, None]
        out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * so_n + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
) -> None:
    num_tokens, hidden = q.shape
    num_experts, two_inter, _ = gate_up.shape
    dev, top_k = q.device, ids.shape[1]
    assert dtype in _OUT_DTYPES, f"dtype {dtype}: one of {sorted(map(str, _OUT_DTYPES))}"
    expect(q, "q", (num_tokens, hidden), (FP8,), dev)
    expect(q_scale, "q_scale", (num_tokens, 1), (torch.float32,), dev)
    expect(gate_up, "gate_up", (num_experts, two_inter, hidden), (FP8,), dev)
    expect(down, "down", (num_experts, hidden, two_inter // 2), (FP8,), dev)
    for name, scale, weight in (
        ("gate_up_scale", gate_up_scale, gate_up),
        ("down_scale", down_scale, down),
    ):
        expect(scale, name, (*weight.shape[:2], 1), (torch.float32,), dev)
    expect(weights, "weights", (num_tokens, top_k), (torch.float32,), dev)
    expect(ids, "ids", (num_tokens, top_k), (torch.int64, torch.int32), dev)
    assert q.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1, "rows packed"


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
    """See `reference.fp8_moe_rows`: FP8 rows q [N, H] with per-token scales [N, 1], FP8
    experts with per-channel scales. Returns [N, H] in `dtype` (see the module docstring)."""
    del segments  # batch invariant by construction
    _check(q, q_scale, gate_up, gate_up_scale, down, down_scale, weights, ids, dtype)
    num_tokens, hidden = q.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k, dev = two_inter // 2, ids.shape[1], q.device
    num_pairs = num_tokens * top_k
    out_pairs = torch.empty(num_pairs, hidden, dtype=dtype, device=dev)
    if num_pairs == 0:
        return torch.zeros(num_tokens, hidden, dtype=dtype, device=dev)
    q_scale = q_scale.contiguous()  # one per token, read at the token's index
    block_m = expert_block_m()
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    capacity = sorted_pairs.shape[0]
    act = torch.empty(capacity, inter, dtype=FP8, device=dev)
    act_scale = torch.empty(
        capacity, triton.cdiv(inter, ACT_GROUP), dtype=torch.float32, device=dev
    )
    common = dict(
        TOP_K=top_k, DT=_OUT_DTYPES[dtype], BLOCK_M=block_m, BLOCK_K=ACT_GROUP, FP8_MAX=FP8_MAX,
        FLOOR=SCALE_FLOOR,
    )  # fmt: skip
    _fp8_expert_gemm_kernel[(block_expert.shape[0], triton.cdiv(inter, ACT_GROUP))](
        q, q_scale, gate_up, gate_up_scale, act, act_scale, weights, sorted_pairs, block_expert,
        num_pairs, num_experts, hidden, inter, q.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), act.stride(0), weights.stride(0),
        weights.stride(1), GEGLU=True,
        BLOCK_N=ACT_GROUP, num_warps=8, **common,
    )  # fmt: skip
    _fp8_expert_gemm_kernel[(block_expert.shape[0], triton.cdiv(hidden, ACT_GROUP))](
        act, act_scale, down, down_scale, out_pairs, act_scale, weights, sorted_pairs,
        block_expert, num_pairs, num_experts, inter, hidden, act.stride(0), down.stride(0),
        down.stride(1), down_scale.stride(0), down_scale.stride(1), out_pairs.stride(0),
        weights.stride(0), weights.stride(1), GEGLU=False,
        BLOCK_N=ACT_GROUP, num_warps=8, **common,
    )  # fmt: skip
    # Sum over the slots in (token, slot) order in fp32, as the twin does, and cast: one pass.
    return slot_sum(out_pairs, num_tokens, top_k, dtype)


KERNELS = (fp8_moe_rows,)
