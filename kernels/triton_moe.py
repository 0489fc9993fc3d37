"""The DiffusionGemma router and fused mixture of experts, in Triton. Twins:
`reference.route_experts`, `reference.fused_moe`, `reference.fp8_moe`, `reference.grouped_mm`,
`reference.align_pairs` (same signatures).

- Router: one program per block of tokens computes rmsnorm(hidden) * scale / sqrt(H), the
  expert scores, the fp32 softmax, the top-k (ties to the lowest expert id), the renormalised
  weights and the per_expert_scale product, without writing the scores.
- Experts: token-expert pairs are grouped by expert into blocks of BLOCK_M rows (each block
  belongs to one expert; padding rows are skipped; `align_pairs`: a stable counting sort in
  three launches, no host sync), then two grouped GEMMs: gate_up with the
  GeGLU (gelu tanh) epilogue, and down with the routing weight epilogue. Pair outputs land in
  (token, slot) order, in the hidden dtype (the twin's are fp32: one more rounding per pair in
  bf16, half the traffic), and are summed over the slots in fp32, as the twin does, and cast
  to the hidden dtype in one pass (`_slot_sum_kernel`).
- FP8 experts (`fp8_moe`): the same launches over FP8 E4M3 weights, read as FP8 (half the
  bytes), cast to the hidden dtype in registers, with each accumulator times its output
  channels' scales before the output rounding; activations stay in the hidden dtype.

Every pair's value is computed by one program over a fixed K order, independent of the other
pairs, so results are batch invariant by construction; `segments` is accepted and not needed.
Intermediate roundings follow the twin (outputs of each GEMM in the weight dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import ALIGN_CHUNK, align_capacity
from kernels.support import dot_precision, expect, interpreting

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["num_tokens"])
def _router_kernel(
    h_ptr, scale_ptr, proj_ptr, pes_ptr, w_ptr, id_ptr,
    num_tokens, hidden, num_experts, sh_n, sp_e, sw_n, si_n, eps, inv_sqrt_hidden,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < num_tokens
    row_ptr = h_ptr + rows.to(tl.int64)[:, None] * sh_n
    dt = h_ptr.dtype.element_ty
    sum_sq = tl.zeros([BLOCK_M], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(row_ptr + c[None, :], mask=r_mask[:, None] & (c < hidden)[None, :], other=0.0)
        x = x.to(tl.float32)
        sum_sq += tl.sum(x * x, 1)
    rstd = 1.0 / tl.sqrt(sum_sq / hidden + eps)
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    scores = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        c = h0 + tl.arange(0, BLOCK_H)
        c_mask = c < hidden
        x = tl.load(row_ptr + c[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        # The twin's roundings: rms_norm returns the input dtype, then two products in it.
        x = (x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)
        x = (x * tl.load(scale_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]).to(dt)
        x = (x.to(tl.float32) * inv_sqrt_hidden).to(dt)
        w = tl.load(
            proj_ptr + e[None, :] * sp_e + c[:, None], mask=c_mask[:, None] & e_mask[None, :]
        )
        scores = tl.dot(x, w, scores, input_precision=PRECISION)
    scores = tl.where(e_mask[None, :], scores.to(dt).to(tl.float32), float("-inf"))
    probs = tl.exp(scores - tl.max(scores, 1)[:, None])
    probs = probs / tl.sum(probs, 1)[:, None]
    probs = tl.where(e_mask[None, :], probs, -1.0)  # padding lanes are never chosen
    slot = tl.arange(0, K_PAD)
    top = tl.zeros([BLOCK_M, K_PAD], tl.float32)
    top_ids = tl.zeros([BLOCK_M, K_PAD], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, 1)
        best_id = tl.argmax(probs, 1, tie_break_left=True)
        top = tl.where(slot[None, :] == i, best[:, None], top)
        top_ids = tl.where(slot[None, :] == i, best_id[:, None], top_ids)
        probs = tl.where(e[None, :] == best_id[:, None], -1.0, probs)
    weights = top / tl.sum(top, 1)[:, None]
    out_mask = r_mask[:, None] & (slot < TOP_K)[None, :]
    weights *= tl.load(pes_ptr + top_ids, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(w_ptr + rows[:, None] * sw_n + slot[None, :], weights, mask=out_mask)
    tl.store(id_ptr + rows[:, None] * si_n + slot[None, :], top_ids.to(tl.int64), mask=out_mask)


@triton.jit
def gelu_tanh(x):
    # tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf, no libdevice needed.
    y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))


# Epilogues of the expert GEMM (constexpr globals: the kernel branches on them at compile time).
PLAIN = tl.constexpr(0)
GEGLU = tl.constexpr(1)
WEIGHTED = tl.constexpr(2)


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_gemm_kernel(
    x_ptr, w_ptr, out_ptr, weights_ptr, pairs_ptr, block_expert_ptr,
    scale_ptr, num_pairs, num_experts, k_dim, n_dim, sx_n, sw_e, sw_o, so_n, sr_n, sr_k, ss_e,
    ss_o, TOP_K: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """One expert block x one column block of x @ W[expert]^T. PLAIN: rows gathered by pair,
    output by pair. GEGLU (W = gate_up): rows gathered by token (pair // TOP_K), output
    gelu(gate) * up in padded-row order. WEIGHTED (W = down): rows in padded-row order, output
    times the pair's routing weight, in out's dtype, by pair (= token * TOP_K + slot).
    SCALED: W is FP8 with one fp32 scale per output channel (scale_ptr [E, Out]); its tiles
    are cast to x's dtype in registers (exact: every E4M3 value is a bf16) and each fp32
    accumulator is multiplied by its columns' scales before the output rounding."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair < num_pairs
    x_rows = rows if EPILOGUE == WEIGHTED else pair // TOP_K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < n_dim
    w_base = w_ptr + expert.to(tl.int64) * sw_e
    # SCALED: the twin's dequantized weights are in x's dtype.
    dt = x_ptr.dtype.element_ty if SCALED else w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < k_dim
        x = tl.load(
            x_ptr + x_rows.to(tl.int64)[:, None] * sx_n + kk[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        ).to(dt)
        w_mask = k_mask[:, None] & c_mask[None, :]
        w = tl.load(w_base + cols[None, :] * sw_o + kk[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(x, w.to(dt), acc, input_precision=PRECISION)
        if EPILOGUE == GEGLU:
            w_up = tl.load(
                w_base + (cols + n_dim)[None, :] * sw_o + kk[:, None], mask=w_mask, other=0.0
            )
            acc_up = tl.dot(x, w_up.to(dt), acc_up, input_precision=PRECISION)
    if SCALED:
        s_base = scale_ptr + expert.to(tl.int64) * ss_e
        acc *= tl.load(s_base + cols * ss_o, mask=c_mask, other=0.0)[None, :]
        if EPILOGUE == GEGLU:
            acc_up *= tl.load(s_base + (cols + n_dim) * ss_o, mask=c_mask, other=0.0)[None, :]
    mask = valid[:, None] & c_mask[None, :]
    acc = acc.to(dt).to(tl.float32)  # each grouped GEMM's output is in the weight dtype
    out_rows = rows if EPILOGUE == GEGLU else pair
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * so_n + cols[None, :]
    if EPILOGUE == GEGLU:
        acc = gelu_tanh(acc).to(dt).to(tl.float32) * acc_up.to(dt).to(tl.float32)
    if EPILOGUE == WEIGHTED:
        token, slot = pair // TOP_K, pair % TOP_K
        acc *= tl.load(weights_ptr + token * sr_n + slot * sr_k, mask=valid, other=0.0)[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _slot_sum_kernel(
    pairs_ptr, out_ptr, num_tokens, hidden, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[token] = the sum of its TOP_K weighted pair rows (fp32, in slot order), in out's
    dtype: the twin's sum over the slots and its cast in one pass."""
    tokens = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (tokens < num_tokens)[:, None] & (cols < hidden)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    for slot in tl.static_range(TOP_K):
        rows = tokens * TOP_K + slot
        row = tl.load(pairs_ptr + rows[:, None] * hidden + cols[None, :], mask=mask, other=0.0)
        acc += row.to(tl.float32)
    out = out_ptr + tokens[:, None] * hidden + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def slot_sum(
    out_pairs: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """[N * K, H] pair rows to [N, H] in `dtype`, summed in fp32 (`_slot_sum_kernel`)."""
    hidden = out_pairs.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=out_pairs.device)
    block_n, block_h = (64, 1024) if interpreting() else (4, 512)
    grid = (triton.cdiv(num_tokens, block_n), triton.cdiv(hidden, block_h))
    _slot_sum_kernel[grid](
        out_pairs, out, num_tokens, hidden, TOP_K=top_k, BLOCK_N=block_n, BLOCK_H=block_h
    )
    return out


def expert_block_m() -> int:
    # Fixed (not chosen from the token count) so that each pair's arithmetic never depends on
    # the batch; 64 rows fill a Hopper warpgroup MMA.
    return 16 if interpreting() else 64


@triton.jit
def _chunk_onehot(ids_ptr, chunk, num_pairs, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """The chunk's pair ids [CHUNK] and their experts one-hot [CHUNK, E_PAD] (int32)."""
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=E_PAD).to(tl.int32)
    return pairs, (expert[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_counts_kernel(
    ids_ptr, hist_ptr, num_pairs, CHUNK: tl.constexpr, E_PAD: tl.constexpr
):  # fmt: skip
    """hist[chunk, e]: the pairs of one chunk of CHUNK pairs that go to expert e."""
    chunk = tl.program_id(0)
    _, onehot = _chunk_onehot(ids_ptr, chunk, num_pairs, CHUNK, E_PAD)
    tl.store(hist_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, 0))


@triton.jit(do_not_specialize=["num_chunks"])
def _expert_offsets_kernel(
    hist_ptr, start_ptr, valid_end_ptr, padded_end_ptr, num_chunks, num_experts, block_m,
    ROWS: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """One program: hist becomes each chunk's exclusive prefix per expert (in place); then each
    expert's first row (padded to whole blocks), end of its pairs and end of its blocks."""
    e = tl.arange(0, E_PAD)
    seen = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        rows = c0 + tl.arange(0, ROWS)
        ptrs = hist_ptr + rows[:, None] * E_PAD + e[None, :]
        tile = tl.load(ptrs, mask=(rows < num_chunks)[:, None], other=0)
        tl.store(ptrs, tl.cumsum(tile, 0) - tile + seen[None, :], mask=(rows < num_chunks)[:, None])
        seen += tl.sum(tile, 0)
    padded = tl.where(e < num_experts, (seen + block_m - 1) // block_m * block_m, 0)
    padded_end = tl.cumsum(padded, 0)
    tl.store(start_ptr + e, padded_end - padded)
    tl.store(valid_end_ptr + e, padded_end - padded + seen)
    tl.store(padded_end_ptr + e, tl.where(e < num_experts, padded_end, 1 << 30))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "blocks_per_program"])
def _place_pairs_kernel(
    ids_ptr, hist_ptr, start_ptr, valid_end_ptr, padded_end_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, num_blocks, blocks_per_program, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    E_PAD: tl.constexpr, TILE_B: tl.constexpr,
):  # fmt: skip
    """Program c: each pair of chunk c to its row (its expert's first row + the pairs of that
    expert in earlier chunks + its rank in the chunk: a stable sort); then the expert of each
    of its share of the blocks, and the padding rows of those blocks."""
    chunk = tl.program_id(0)
    slot = tl.arange(0, CHUNK)
    pairs = chunk * CHUNK + slot
    valid = pairs < num_pairs
    pair_expert = tl.load(ids_ptr + pairs, mask=valid, other=0).to(tl.int32)
    # The pairs of the same expert before each one in the chunk: its rank there.
    same = (pair_expert[:, None] == pair_expert[None, :]) & (slot[None, :] < slot[:, None])
    rank = tl.sum(same.to(tl.int32), 1)
    rank += tl.load(hist_ptr + chunk * E_PAD + pair_expert) + tl.load(start_ptr + pair_expert)
    tl.store(sorted_ptr + rank, pairs.to(tl.int32), mask=valid)
    padded_end = tl.load(padded_end_ptr + tl.arange(0, E_PAD))
    first = chunk * blocks_per_program
    last = tl.minimum(first + blocks_per_program, num_blocks)
    for b0 in range(first, last, TILE_B):
        blocks = b0 + tl.arange(0, TILE_B)
        in_range = blocks < last
        rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [TILE_B, BLOCK_M]
        # searchsorted(padded_end, block start, right=True); unused blocks get num_experts.
        expert = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + blocks, expert, mask=in_range)
        valid_end = tl.load(valid_end_ptr + expert, mask=in_range & (expert < E_PAD), other=0)
        pad = in_range[:, None] & (rows >= valid_end[:, None])
        tl.store(sorted_ptr + rows, tl.zeros(rows.shape, tl.int32) + num_pairs, mask=pad)


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.align_pairs` (the same outputs), in three launches and without a host
    sync: per-chunk expert counts, one program's prefix sums over chunks and experts, then
    each chunk's pairs placed by rank (and the block map and padding rows written)."""
    flat = ids.reshape(-1)
    num_pairs, dev = flat.numel(), ids.device
    capacity = align_capacity(num_pairs, num_experts, block_m)
    num_blocks = capacity // block_m
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    if num_pairs == 0:
        return sorted_pairs, block_expert
    assert block_m & (block_m - 1) == 0, f"block_m must be a power of two, got {block_m}"
    chunk, e_pad = ALIGN_CHUNK, max(16, triton.next_power_of_2(num_experts))
    num_chunks = triton.cdiv(num_pairs, chunk)
    hist = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
    ends = torch.empty(3, e_pad, dtype=torch.int32, device=dev)  # start, valid end, padded end
    _chunk_counts_kernel[(num_chunks,)](
        flat, hist, num_pairs, CHUNK=chunk, E_PAD=e_pad, num_warps=8
    )
    _expert_offsets_kernel[(1,)](
        hist, ends[0], ends[1], ends[2], num_chunks, num_experts, block_m, ROWS=32, E_PAD=e_pad
    )
    _place_pairs_kernel[(num_chunks,)](
        flat, hist, ends[0], ends[1], ends[2], sorted_pairs, block_expert, num_pairs, num_blocks,
        triton.cdiv(num_blocks, num_chunks), BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad,
        TILE_B=16, num_warps=8,
    )  # fmt: skip
    return sorted_pairs, block_expert


def _gemm_blocks() -> tuple[int, int]:
    return (32, 32) if interpreting() else (64, 64)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """See `reference.grouped_mm`: rows of x [S, In] grouped by expert (offsets [E] int32
    cumulative row counts) times weight [E, Out, In]^T. Returns [S, Out] in weight's dtype."""
    num_rows, in_dim = x.shape
    num_experts, out_dim, _ = weight.shape
    expect(x, "x", (num_rows, in_dim), _FLOATS, x.device)
    expect(weight, "weight", (num_experts, out_dim, in_dim), _FLOATS, x.device)
    expect(offsets, "offsets", (num_experts,), (torch.int32, torch.int64), x.device)
    out = torch.zeros(num_rows, out_dim, dtype=weight.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m, (block_n, block_k) = expert_block_m(), _gemm_blocks()
    row_expert = torch.searchsorted(
        offsets.to(torch.int64), torch.arange(num_rows, device=x.device), right=True
    )  # [S]; rows past offsets[-1] get num_experts and stay zero, as in the twin
    sorted_rows, block_expert = align_pairs(row_expert[:, None], num_experts + 1, block_m)
    block_expert = torch.where(block_expert >= num_experts, num_experts, block_expert)
    _expert_gemm_kernel[(block_expert.shape[0], triton.cdiv(out_dim, block_n))](
        x, weight, out, x, sorted_rows, block_expert, x,
        num_rows, num_experts, in_dim, out_dim, x.stride(0), weight.stride(0), weight.stride(1),
        out.stride(0), 0, 0, 0, 0,
        TOP_K=1, EPILOGUE=PLAIN, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(weight.dtype), SCALED=False, num_warps=4,
    )  # fmt: skip
    return out


def route_experts(
    hidden: torch.Tensor,
    scale: torch.Tensor,
    proj: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
    segments: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See `reference.route_experts`. Returns (weights [N, K] fp32, expert ids [N, K] int64)."""
    del segments  # batch invariant by construction (see the module docstring)
    num_tokens, hidden_size = hidden.shape
    num_experts = proj.shape[0]
    expect(hidden, "hidden", (num_tokens, hidden_size), _FLOATS, hidden.device)
    expect(scale, "scale", (hidden_size,), _FLOATS, hidden.device)
    expect(proj, "proj", (num_experts, hidden_size), (hidden.dtype,), hidden.device)
    expect(per_expert_scale, "per_expert_scale", (num_experts,), _FLOATS, hidden.device)
    assert 0 < top_k <= num_experts, "top_k must be in [1, num_experts]"
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=hidden.device)
    if num_tokens == 0:
        return weights, ids
    block_m = 16
    _router_kernel[(triton.cdiv(num_tokens, block_m),)](
        hidden, scale, proj, per_expert_scale, weights, ids,
        num_tokens, hidden_size, num_experts, hidden.stride(0), proj.stride(0),
        weights.stride(0), ids.stride(0), eps, hidden_size**-0.5,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_M=block_m,
        BLOCK_H=min(64, triton.next_power_of_2(hidden_size)),
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        PRECISION=dot_precision(hidden.dtype),
    )  # fmt: skip
    return weights, ids


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """See `reference.fused_moe`. Returns [N, H] in hidden's dtype."""
    del segments  # batch invariant by construction (see the module docstring)
    expect(gate_up, "gate_up", (None, None, hidden.shape[1]), _FLOATS, hidden.device)
    expect(down, "down", (gate_up.shape[0], hidden.shape[1], None), _FLOATS, hidden.device)
    return _experts(hidden, gate_up, down, weights, ids)


def fp8_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """See `reference.fp8_moe`: the experts over FP8 E4M3 weights (gate_up [E, 2I, H], down
    [E, H, I]) with fp32 scales per output channel ([E, 2I, 1], [E, H, 1]). The kernels read
    the FP8 bytes (half of bf16's) and dequantize in registers (`_expert_gemm_kernel`'s
    SCALED); activations stay in hidden's dtype. Returns [N, H] in hidden's dtype."""
    del segments  # batch invariant by construction (see the module docstring)
    num_experts, hidden_size = gate_up.shape[0], hidden.shape[1]
    fp8 = (torch.float8_e4m3fn,)
    expect(gate_up, "gate_up", (num_experts, None, hidden_size), fp8, hidden.device)
    expect(down, "down", (num_experts, hidden_size, None), fp8, hidden.device)
    scales = (gate_up_scale, down_scale)
    for name, scale, weight in (
        ("gate_up_scale", gate_up_scale, gate_up),
        ("down_scale", down_scale, down),
    ):
        expect(scale, name, (*weight.shape[:2], 1), (torch.float32,), hidden.device)
        assert scale.stride(1) == 1, f"{name}: output channels must be contiguous"
    return _experts(hidden, gate_up, down, weights, ids, scales)


def _experts(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`fused_moe`'s launches; `scales` (gate_up's, down's): the weights are FP8."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2, ids.shape[1]
    dev = hidden.device
    expect(hidden, "hidden", (num_tokens, hidden_size), _FLOATS, dev)
    expect(gate_up, "gate_up", (num_experts, 2 * inter, hidden_size), (gate_up.dtype,), dev)
    expect(down, "down", (num_experts, hidden_size, inter), (gate_up.dtype,), dev)
    expect(weights, "weights", (num_tokens, top_k), (torch.float32,), dev)
    expect(ids, "ids", (num_tokens, top_k), (torch.int64, torch.int32), dev)
    assert gate_up.stride(1) == hidden_size and down.stride(1) == inter, "expert rows packed"
    num_pairs = num_tokens * top_k
    # No zero fill: align_pairs places every pair in exactly one row of an expert's block, so
    # the down GEMM writes each row of every column block once. Weighted pair rows are kept in
    # the hidden dtype (the twin keeps fp32): in bf16 that halves the step's largest MoE traffic
    # (8 rows per token written, then read by the slot sum) for one more rounding per pair.
    out_pairs = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=dev)
    if num_pairs == 0:
        return out_pairs.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
    block_m = expert_block_m()
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    compute = gate_up.dtype if scales is None else hidden.dtype  # the (dequantized) weights'
    act = torch.empty(sorted_pairs.shape[0], inter, dtype=compute, device=dev)
    block_n, block_k = _gemm_blocks()
    common = dict(
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(compute), SCALED=scales is not None, num_warps=4,
    )  # fmt: skip
    gate_up_scale, down_scale = scales or (gate_up, down)  # unread where not SCALED
    _expert_gemm_kernel[(block_expert.shape[0], triton.cdiv(inter, block_n))](
        hidden, gate_up, act, weights, sorted_pairs, block_expert, gate_up_scale,
        num_pairs, num_experts, hidden_size, inter, hidden.stride(0), gate_up.stride(0),
        gate_up.stride(1), act.stride(0), weights.stride(0), weights.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), EPILOGUE=GEGLU, **common,
    )  # fmt: skip
    _expert_gemm_kernel[(block_expert.shape[0], triton.cdiv(hidden_size, block_n))](
        act, down, out_pairs, weights, sorted_pairs, block_expert, down_scale,
        num_pairs, num_experts, inter, hidden_size, act.stride(0), down.stride(0),
        down.stride(1), out_pairs.stride(0), weights.stride(0), weights.stride(1),
        down_scale.stride(0), down_scale.stride(1), EPILOGUE=WEIGHTED, **common,
    )  # fmt: skip
    # Sum over the slots in (token, slot) order in fp32, as the twin does, and cast: one pass.
    return slot_sum(out_pairs, num_tokens, top_k, hidden.dtype)


KERNELS = (route_experts, fused_moe, fp8_moe, grouped_mm)
