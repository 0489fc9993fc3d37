"""The fused diffusion sampler, in Triton. Twins: `reference.fused_sample`,
`reference.entropy_accept`, `reference.soft_embedding`, `reference.sample_and_embed`,
`reference.philox_uniform` (same signatures, same contracts).

- `fused_sample`: one program per canvas position streams its logits over the vocabulary
  (BLOCK_V at a time): a first pass keeps, per lane, an online softmax (max, normaliser, sum
  of p * log p terms) and the argmax; a second pass walks the cumulative probabilities tile by
  tile to the one uniform number of the position (inverse transform sampling). Nothing of
  size V is written: the outputs are four numbers per position.
- `entropy_accept`: one program per canvas sorts (entropy, position) pairs packed into int64
  keys, takes the exclusive prefix sum and scatters the acceptance back.
- `soft_embedding`: the probabilities exp(logits / T - lse) written once in the embedding's
  dtype, a chunk of positions at a time (one read of the fp32 logits), then the twin's GEMM
  (cuBLAS on a GPU: fp32 accumulation, as the twin). In `sample_and_embed` the sampler's second
  pass writes them, so the logits are read twice in all (a kernel that made them inside the
  GEMM re-read and re-exponentiated the logits once per 128 hidden columns: 22 times).
- `philox_uniform`: `tl.rand` per (seed, counter) pair, broadcast through strides: one launch
  where the PyTorch twin is ~200 small ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import SampleResult
from kernels.reference_sampler import PROBS_CHUNK_BYTES
from kernels.support import expect, interpreting


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
    sample_ptr, argmax_ptr, entropy_ptr, lse_ptr, probs_ptr,
    vocab, stride_p, stride_q, BLOCK_V: tl.constexpr, WRITE_PROBS: tl.constexpr,
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
        if WRITE_PROBS:  # the soft embedding's A operand, in the embedding's dtype
            probs = (e / z_all).to(probs_ptr.dtype.element_ty)
            tl.store(probs_ptr + pos.to(tl.int64) * stride_q + cols, probs, mask=mask)
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
def _probs_kernel(
    logits_ptr, temp_ptr, lse_ptr, probs_ptr, vocab, stride_p, stride_q, BLOCK_V: tl.constexpr
):
    pos = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab
    x = tl.load(logits_ptr + pos.to(tl.int64) * stride_p + cols, mask=mask, other=float("-inf"))
    probs = tl.exp(x / tl.load(temp_ptr + pos) - tl.load(lse_ptr + pos))
    out = probs_ptr + pos.to(tl.int64) * stride_q + cols
    tl.store(out, probs.to(probs_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num", "cols", "stride_sr", "stride_sc", "stride_cr", "stride_cc"])
def _philox_kernel(
    seed_ptr, counter_ptr, out_ptr, num, cols, stride_sr, stride_sc, stride_cr, stride_cc,
    BLOCK: tl.constexpr,
):  # fmt: skip
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < num
    row, col = idx // cols, idx % cols
    seed = tl.load(seed_ptr + row * stride_sr + col * stride_sc, mask=mask, other=0)
    counter = tl.load(counter_ptr + row * stride_cr + col * stride_cc, mask=mask, other=0)
    tl.store(out_ptr + idx, tl.rand(seed, counter), mask=mask)


def _check_positions(logits: torch.Tensor, *per_position: tuple[torch.Tensor, str, torch.dtype]):
    num_pos = logits.shape[0]
    expect(logits, "logits", (num_pos, None), (torch.float32,), logits.device)
    for tensor, name, dtype in per_position:
        expect(tensor, name, (num_pos,), (dtype,), logits.device)


def _results(num_pos: int, device: torch.device) -> SampleResult:
    return SampleResult(
        sample=torch.empty(num_pos, dtype=torch.int64, device=device),
        argmax=torch.empty(num_pos, dtype=torch.int64, device=device),
        entropy=torch.empty(num_pos, dtype=torch.float32, device=device),
        lse=torch.empty(num_pos, dtype=torch.float32, device=device),
    )


def _launch_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    out: SampleResult,
    probs: torch.Tensor | None,
) -> None:
    """`_sample_kernel` over the positions of `logits` into `out`; with `probs` ([P, V]),
    the softmax is written there too (during the pass that reads the logits anyway)."""
    num_pos, vocab = logits.shape
    block_v = min(64 if interpreting() else 2048, triton.next_power_of_2(vocab))
    _sample_kernel[(num_pos,)](
        logits, temperature, uniform, out.sample, out.argmax, out.entropy, out.lse,
        logits if probs is None else probs, vocab, logits.stride(0),
        0 if probs is None else probs.stride(0),
        BLOCK_V=block_v, WRITE_PROBS=probs is not None, num_warps=8,
    )  # fmt: skip


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> SampleResult:
    """See `reference.fused_sample`."""
    _check_positions(
        logits, (temperature, "temperature", torch.float32), (uniform, "uniform", torch.float32)
    )
    result = _results(logits.shape[0], logits.device)
    if logits.shape[0]:
        _launch_sample(logits, temperature, uniform, result, None)
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


def _check_embedding(logits: torch.Tensor, weight: torch.Tensor) -> list[slice]:
    """Check the embedding matrix [V, H]; the position chunks of the probabilities."""
    num_pos, vocab = logits.shape
    floats = (torch.float32, torch.bfloat16, torch.float16)
    expect(weight, "weight", (vocab, weight.shape[1]), floats, logits.device)
    chunk = max(1, PROBS_CHUNK_BYTES // max(1, vocab * weight.element_size()))
    return [slice(p0, min(p0 + chunk, num_pos)) for p0 in range(0, num_pos, chunk)]


def soft_embedding(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See `reference.soft_embedding`. Returns [P, H] in weight's dtype: the probabilities
    exp(logits / T - lse) written once in weight's dtype (one read of the logits), then the
    twin's GEMM (cuBLAS on a GPU) and scale."""
    _check_positions(
        logits, (temperature, "temperature", torch.float32), (lse, "lse", torch.float32)
    )
    chunks = _check_embedding(logits, weight)
    num_pos, vocab = logits.shape
    out = torch.empty(num_pos, weight.shape[1], dtype=weight.dtype, device=logits.device)
    if chunks:
        probs = torch.empty(chunks[0].stop, vocab, dtype=weight.dtype, device=logits.device)
        block_v = min(1 << 14 if interpreting() else 2048, triton.next_power_of_2(vocab))
        for rows in chunks:
            part = probs[: rows.stop - rows.start]
            _probs_kernel[(part.shape[0], triton.cdiv(vocab, block_v))](
                logits[rows], temperature[rows], lse[rows], part, vocab, logits.stride(0),
                part.stride(0), BLOCK_V=block_v, num_warps=4,
            )  # fmt: skip
            torch.matmul(part, weight, out=out[rows])
    # A host scalar tensor (a kernel argument): one made on the device would be a blocking copy.
    return out * torch.tensor(scale, dtype=weight.dtype)


def sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> tuple[SampleResult, torch.Tensor]:
    """See `reference.sample_and_embed`: the sampler kernel also writes the probabilities (in
    weight's dtype, during its second pass over the logits), then the twin's GEMM and scale;
    a chunk of positions at a time (`PROBS_CHUNK_BYTES`)."""
    _check_positions(
        logits, (temperature, "temperature", torch.float32), (uniform, "uniform", torch.float32)
    )
    chunks = _check_embedding(logits, weight)
    num_pos, vocab = logits.shape
    result = _results(num_pos, logits.device)
    soft = torch.empty(num_pos, weight.shape[1], dtype=weight.dtype, device=logits.device)
    if chunks:
        probs = torch.empty(chunks[0].stop, vocab, dtype=weight.dtype, device=logits.device)
        for rows in chunks:
            part = probs[: rows.stop - rows.start]
            out = SampleResult(*(getattr(result, f)[rows] for f in _FIELDS))
            _launch_sample(logits[rows], temperature[rows], uniform[rows], out, part)
            torch.matmul(part, weight, out=soft[rows])
    return result, soft * torch.tensor(scale, dtype=weight.dtype)


def philox_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """See `reference.philox_uniform` (`tl.rand` itself, so bit for bit): int64 seeds and
    counters, broadcastable, read through their strides (broadcasts copy nothing up to two
    dimensions). Returns fp32 of the broadcast shape."""
    assert seeds.dtype == counters.dtype == torch.int64, "seeds and counters must be int64"
    assert seeds.device == counters.device, "seeds and counters must be on one device"
    shape = torch.broadcast_shapes(seeds.shape, counters.shape)
    out = torch.empty(shape, dtype=torch.float32, device=counters.device)
    cols = shape[-1] if shape else 1
    if out.numel() == 0:
        return out
    s2, c2 = (t.expand(shape).reshape(-1, cols) for t in (seeds, counters))
    block = 1 << 14 if interpreting() else 1024
    _philox_kernel[(triton.cdiv(out.numel(), block),)](
        s2, c2, out, out.numel(), cols, *s2.stride(), *c2.stride(), BLOCK=block, num_warps=4
    )
    return out


_FIELDS = ("sample", "argmax", "entropy", "lse")

KERNELS = (fused_sample, entropy_accept, soft_embedding, sample_and_embed, philox_uniform)
