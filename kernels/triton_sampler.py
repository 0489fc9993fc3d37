"""The fused diffusion sampler, in Triton. Twins: `reference.fused_sample`,
`reference.entropy_accept`, `reference.soft_embedding` (same signatures, same contracts).

- `fused_sample`: one program per canvas position streams its logits over the vocabulary
  (BLOCK_V at a time): a first pass keeps, per lane, an online softmax (max, normaliser, sum
  of p * log p terms) and the argmax; a second pass walks the cumulative probabilities tile by
  tile to the one uniform number of the position (inverse transform sampling). Nothing of
  size V is written: the outputs are four numbers per position.
- `entropy_accept`: one program per canvas sorts (entropy, position) pairs packed into int64
  keys, takes the exclusive prefix sum and scatters the acceptance back.
- `soft_embedding`: a GEMM whose A operand, the probabilities exp(logits / T - lse), is
  computed from the logits tile by tile and never stored; split over the vocabulary with an
  fp32 partial sum per split, reduced in a fixed order (deterministic, batch invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import dot_precision, expect, interpreting
from kernels.reference import SampleResult


@triton.jit
def _argmax_update(best, best_id, value, index):
    # Strictly greater keeps the earliest index of each lane: ties go to the lowest index.
    take = value > best
    return tl.where(take, value, best), tl.where(take, index, best_id)


@triton.jit
def _argmax_finish(best, best_id, vocab):
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, best_id, vocab), 0)


@triton.jit
def _sample_kernel(
    logits_ptr, temp_ptr, uniform_ptr,
    sample_ptr, argmax_ptr, entropy_ptr, lse_ptr,
    vocab, stride_p, BLOCK_V: tl.constexpr,
):  # fmt: skip
    pos = tl.program_id(0)
    row = logits_ptr + pos.to(tl.int64) * stride_p
    temp = tl.load(temp_ptr + pos)
    lane = tl.arange(0, BLOCK_V)
    neg_inf = tl.full([BLOCK_V], float("-inf"), tl.float32)
    m = neg_inf  # per-lane running max of s = logits / T
    z = tl.zeros([BLOCK_V], tl.float32)  # sum exp(s - m)
    a = tl.zeros([BLOCK_V], tl.float32)  # sum exp(s - m) * (s - m)
    top, top_id = neg_inf, tl.zeros([BLOCK_V], tl.int32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + lane
        mask = cols < vocab
        s = tl.load(row + cols, mask=mask, other=float("-inf")) / temp
        top, top_id = _argmax_update(top, top_id, s, cols)
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        shift = m_safe - tl.where(m == float("-inf"), m_safe, m)  # 0 while the lane is empty
        decay = tl.exp(-shift)
        t = s - m_safe
        e = tl.exp(t)
        a = decay * (a - shift * z) + e * tl.where(e > 0.0, t, 0.0)  # 0 * -inf would be NaN
        z = decay * z + e
        m = m_new
    # Combine the lanes: rescale each to the global max.
    m_all = tl.max(m, 0)
    shift = m_all - tl.where(z > 0.0, m, m_all)  # empty lanes (m = -inf) contribute nothing
    decay = tl.exp(-shift)
    z_all = tl.sum(decay * z, 0)
    a_all = tl.sum(decay * (a - shift * z), 0)
    log_z = tl.log(z_all)
    tl.store(entropy_ptr + pos, tl.maximum(log_z - a_all / z_all, 0.0))
    tl.store(lse_ptr + pos, m_all + log_z)
    tl.store(argmax_ptr + pos, _argmax_finish(top, top_id, vocab).to(tl.int64))
    # Inverse transform: the first index whose running sum of exp(s - max) exceeds u * total.
    target = tl.load(uniform_ptr + pos) * z_all
    running = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    found = tl.max(tl.zeros([BLOCK_V], tl.int32), 0) + vocab
    # The last index with a non-zero probability: rounding can leave u * total unmet.
    last = tl.max(tl.zeros([BLOCK_V], tl.int32), 0)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + lane
        mask = cols < vocab
        s = tl.load(row + cols, mask=mask, other=float("-inf")) / temp
        e = tl.where(mask, tl.exp(s - m_all), 0.0)
        cdf = tl.cumsum(e, 0) + running
        found = tl.minimum(found, tl.min(tl.where((cdf > target) & mask, cols, vocab), 0))
        last = tl.maximum(last, tl.max(tl.where(e > 0.0, cols, 0), 0))
        running += tl.sum(e, 0)
    tl.store(sample_ptr + pos, tl.where(found < vocab, found, last).to(tl.int64))


@triton.jit
def _accept_kernel(
    entropy_ptr, bound_ptr, out_ptr, length, stride_e, stride_o, BLOCK_L: tl.constexpr
):
    row = tl.program_id(0)
    idx = tl.arange(0, BLOCK_L)
    mask = idx < length
    e = tl.load(entropy_ptr + row * stride_e + idx, mask=mask, other=float("inf"))
    # Order-preserving int32 image of an fp32 (negatives flipped), then (key, position) as one
    # int64 so that a plain sort orders by entropy with ties by position (a stable sort).
    bits = e.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    packed = (key.to(tl.int64) << 32) | idx.to(tl.int64)
    order = (tl.sort(packed) & 0xFFFFFFFF).to(tl.int32)
    valid = order < length
    sorted_e = tl.load(entropy_ptr + row * stride_e + order, mask=valid, other=0.0)
    before = tl.cumsum(sorted_e, 0) - sorted_e
    accept = before <= tl.load(bound_ptr + row)
    tl.store(out_ptr + row * stride_o + order, accept.to(tl.int8), mask=valid)


@triton.jit
def _soft_embedding_kernel(
    logits_ptr, temp_ptr, lse_ptr, w_ptr, part_ptr,
    num_pos, vocab, hidden, stride_p, stride_v, stride_s, split_len, num_m, num_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # Position blocks vary fastest, so programs sharing an embedding tile run together and
    # read it from L2 once.
    pid = tl.program_id(0)
    pid_m, pid_n, split = pid % num_m, (pid // num_m) % num_n, pid // (num_m * num_n)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < num_pos
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < hidden
    temp = tl.load(temp_ptr + rows, mask=r_mask, other=1.0)
    lse = tl.load(lse_ptr + rows, mask=r_mask, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    v_end = tl.minimum(vocab, (split + 1) * split_len)
    for v0 in range(split * split_len, v_end, BLOCK_K):
        kk = v0 + tl.arange(0, BLOCK_K)
        k_mask = kk < v_end
        x = tl.load(
            logits_ptr + rows.to(tl.int64)[:, None] * stride_p + kk[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=float("-inf"),
        )
        probs = tl.exp(x / temp[:, None] - lse[:, None])
        w = tl.load(
            w_ptr + kk.to(tl.int64)[:, None] * stride_v + cols[None, :],
            mask=k_mask[:, None] & c_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(probs.to(w.dtype), w, acc, input_precision=PRECISION)
    out = part_ptr + split * stride_s + rows[:, None] * hidden + cols[None, :]
    tl.store(out, acc, mask=r_mask[:, None] & c_mask[None, :])


def _check_positions(logits: torch.Tensor, *per_position: tuple[torch.Tensor, str, torch.dtype]):
    num_pos = logits.shape[0]
    expect(logits, "logits", (num_pos, None), (torch.float32,), logits.device)
    for tensor, name, dtype in per_position:
        expect(tensor, name, (num_pos,), (dtype,), logits.device)


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> SampleResult:
    """See `reference.fused_sample`."""
    _check_positions(
        logits, (temperature, "temperature", torch.float32), (uniform, "uniform", torch.float32)
    )
    num_pos, vocab = logits.shape
    dev = logits.device
    result = SampleResult(
        sample=torch.empty(num_pos, dtype=torch.int64, device=dev),
        argmax=torch.empty(num_pos, dtype=torch.int64, device=dev),
        entropy=torch.empty(num_pos, dtype=torch.float32, device=dev),
        lse=torch.empty(num_pos, dtype=torch.float32, device=dev),
    )
    if num_pos == 0:
        return result
    block_v = min(64 if interpreting() else 2048, triton.next_power_of_2(vocab))
    _sample_kernel[(num_pos,)](
        logits, temperature, uniform,
        result.sample, result.argmax, result.entropy, result.lse,
        vocab, logits.stride(0), BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    return result


def entropy_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """See `reference.entropy_accept`. Returns bool [R, L]."""
    num_rows, length = entropy.shape
    expect(entropy, "entropy", (num_rows, length), (torch.float32,), entropy.device)
    expect(bound, "bound", (num_rows,), (torch.float32,), entropy.device)
    out = torch.empty(num_rows, length, dtype=torch.int8, device=entropy.device)
    if num_rows and length:
        _accept_kernel[(num_rows,)](
            entropy, bound, out, length, entropy.stride(0), out.stride(0),
            BLOCK_L=triton.next_power_of_2(length),
        )  # fmt: skip
    return out.bool()


# Vocabulary splits of the soft-embedding GEMM: a constant, so that the fp32 partial sums of
# a position never depend on the batch.
SOFT_EMBEDDING_SPLITS = 8


def soft_embedding(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See `reference.soft_embedding`. Returns [P, H] in weight's dtype."""
    _check_positions(
        logits, (temperature, "temperature", torch.float32), (lse, "lse", torch.float32)
    )
    num_pos, vocab = logits.shape
    hidden = weight.shape[1]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    expect(weight, "weight", (vocab, hidden), floats, logits.device)
    splits = SOFT_EMBEDDING_SPLITS
    parts = torch.empty(splits, num_pos, hidden, dtype=torch.float32, device=logits.device)
    if num_pos:
        block_m, block_n, block_k = (16, 16, 16) if interpreting() else (64, 128, 64)
        split_len = triton.cdiv(triton.cdiv(vocab, splits), block_k) * block_k
        num_m, num_n = triton.cdiv(num_pos, block_m), triton.cdiv(hidden, block_n)
        _soft_embedding_kernel[(num_m * num_n * splits,)](
            logits, temperature, lse, weight, parts,
            num_pos, vocab, hidden, logits.stride(0), weight.stride(0), parts.stride(0),
            split_len, num_m, num_n,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            PRECISION=dot_precision(weight.dtype), num_warps=8,
        )  # fmt: skip
    # Fixed-order sum of the splits; the twin's (bf16) matmul output rounding, then the scale.
    out = parts.sum(0).to(weight.dtype)
    # A host scalar tensor (a kernel argument): one made on the device would be a blocking copy.
    return out * torch.tensor(scale, dtype=weight.dtype)


def sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> tuple[SampleResult, torch.Tensor]:
    """See `reference.sample_and_embed`: the two kernels, the second on the first's lse."""
    result = fused_sample(logits, temperature, uniform)
    return result, soft_embedding(logits, temperature, result.lse, weight, scale)


KERNELS = (fused_sample, entropy_accept, soft_embedding, sample_and_embed)
