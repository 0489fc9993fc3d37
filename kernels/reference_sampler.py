"""PyTorch twins of the fused diffusion sampler (`kernels/triton_sampler.py`): the counter-based
random numbers (Philox, bit for bit Triton's `tl.rand`), inverse-transform sampling with the
entropy and the log-normaliser, entropy-bound acceptance and the soft embedding. Re-exported by
`kernels.reference`, where the engine and the Triton launchers find them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
# Triton's uint32 -> [0, 1) scale: the largest value with (2**31 - 1) * scale < 1 in fp32.
_UNIFORM_SCALE = 4.6566127342e-10


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a uint32 constant and uint32 values held in int64
    (split into 16-bit halves so that no product overflows int64)."""
    p_hi, p_lo = a * (b >> 16), a * (b & 0xFFFF)  # each < 2**48
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return (p_hi + (p_lo >> 16)) >> 16, lo


def philox_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`tl.rand(seed, counter)` bit for bit: Philox4x32-10 keyed by the 64-bit seed on the
    64-bit counter (low word, high word, 0, 0), first output word mapped to [0, 1) as Triton
    does. seeds, counters: int64, broadcastable. Returns fp32 of the broadcast shape.

    On the CPU the rounds run in NumPy's uint64 arithmetic (~140 small operations, a few
    microseconds each cheaper than PyTorch's dispatch: most of a step's sampler time at one
    canvas); elsewhere in int64 tensor operations. Both give the same bits."""
    if seeds.device.type == "cpu" and counters.device.type == "cpu":
        return _philox_uniform_numpy(seeds, counters)
    k0, k1 = seeds & _MASK32, (seeds >> 32) & _MASK32
    c0, c1 = counters & _MASK32, (counters >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(c0)
    c0, c1, k0, k1 = torch.broadcast_tensors(c0, c1, k0, k1)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _MASK32, (k1 + _PHILOX_KEY[1]) & _MASK32
    # Triton reads the word as int32 and folds negatives with ~x: x >= 2**31 -> 2**32 - 1 - x.
    folded = torch.where(c0 >= 2**31, c0 ^ _MASK32, c0)
    return folded.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def _philox_uniform_numpy(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`philox_uniform` for CPU tensors: a uint32 x uint32 product is exact in uint64, so each
    multiply gives its high and low words with one shift and one mask."""
    s, c = np.broadcast_arrays(seeds.numpy().astype(np.uint64), counters.numpy().astype(np.uint64))
    mask, shift = np.uint64(_MASK32), np.uint64(32)
    k0, k1 = s & mask, s >> shift
    c0, c1 = c & mask, c >> shift
    c2 = c3 = np.zeros_like(c0)
    round_a, round_b = np.uint64(_PHILOX_ROUND[0]), np.uint64(_PHILOX_ROUND[1])
    key_a, key_b = np.uint64(_PHILOX_KEY[0]), np.uint64(_PHILOX_KEY[1])
    for _ in range(10):
        prod_b, prod_a = round_b * c2, round_a * c0
        c0, c1, c2, c3 = (
            (prod_b >> shift) ^ c1 ^ k0,
            prod_b & mask,
            (prod_a >> shift) ^ c3 ^ k1,
            prod_a & mask,
        )
        k0, k1 = (k0 + key_a) & mask, (k1 + key_b) & mask
    # Triton reads the word as int32 and folds negatives with ~x: x >= 2**31 -> 2**32 - 1 - x.
    folded = np.where(c0 >= np.uint64(2**31), c0 ^ mask, c0)
    out = torch.from_numpy(folded.astype(np.float32))
    return out * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """Per canvas position: the sampled token, the argmax token (int64), the entropy of the
    softmax and its log-normaliser logsumexp(logits / T) (fp32)."""

    sample: torch.Tensor  # [P] int64
    argmax: torch.Tensor  # [P] int64
    entropy: torch.Tensor  # [P] fp32
    lse: torch.Tensor  # [P] fp32


# Positions per chunk of the twin sampler: bounds its [chunk, V] fp32 temporaries to 64 MiB.
_SAMPLE_CHUNK_ELEMENTS = 1 << 24
# The Triton soft embedding writes its probabilities [chunk, V] (in the embedding's dtype) at
# most this many bytes at a time before their GEMM: 1 GiB, 2,048 positions of a 262,144-token
# vocabulary in bf16.
PROBS_CHUNK_BYTES = 1 << 30
# Probabilities below e^-70 of the largest count as 0 in the twins (mass dropped < V * 4e-31).
_NEGLIGIBLE_LOG_PROB = -70.0
_NEGLIGIBLE_PROB = 4.3e-31  # just above e^-70


def _softmax_rows(scaled: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From s = logits / T [C, V] and its row maxima (s is overwritten with s - max):
    (probs [C, V], log of the normaliser [C]). Entries below e^-70 of the largest get
    probability exactly 0: exp of a very negative number, and arithmetic on the subnormal
    floats it yields, run far slower on x86 CPUs (so would the soft-embedding GEMM over such
    probabilities)."""
    scaled -= top[:, None]
    probs = torch.exp(scaled.clamp_(min=_NEGLIGIBLE_LOG_PROB))
    F.threshold(probs, _NEGLIGIBLE_PROB, 0.0, inplace=True)
    total = probs.sum(-1)
    probs /= total[:, None]
    return probs, total.log()


def _sample_chunk(
    logits: torch.Tensor, temperature: torch.Tensor, out: SampleResult
) -> torch.Tensor:
    """`fused_sample` of a chunk of positions into `out` (already sliced); returns the
    probabilities [C, V] (overwritten with their cumulative sums: callers use them first)."""
    scaled = logits / temperature[:, None]  # [C, V]
    top, argmax = scaled.max(dim=-1)  # first index of the maximum
    out.argmax.copy_(argmax)
    probs, log_z = _softmax_rows(scaled, top)  # scaled now holds s - max (>= -70)
    out.entropy.copy_((log_z - (probs * scaled).sum(-1)).clamp_(min=0))
    out.lse.copy_(top + log_z)
    return probs


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse transform: the first index whose cumulative probability exceeds u (in place:
    `probs` becomes its cumulative sums)."""
    cdf = probs.cumsum_(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def _results(num_positions: int, device: torch.device) -> SampleResult:
    return SampleResult(
        sample=torch.empty(num_positions, dtype=torch.int64, device=device),
        argmax=torch.empty(num_positions, dtype=torch.int64, device=device),
        entropy=torch.empty(num_positions, dtype=torch.float32, device=device),
        lse=torch.empty(num_positions, dtype=torch.float32, device=device),
    )


def _chunks(num_positions: int, vocab: int) -> list[slice]:
    chunk = max(1, _SAMPLE_CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(p0, p0 + chunk) for p0 in range(0, num_positions, chunk)]


def _sliced(result: SampleResult, rows: slice) -> SampleResult:
    return SampleResult(
        result.sample[rows], result.argmax[rows], result.entropy[rows], result.lse[rows]
    )


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> SampleResult:
    """Sample every position from softmax(logits / T) by inverse transform sampling.

    logits: [P, V] fp32; temperature: [P] fp32 (> 0); uniform: [P] fp32 in [0, 1), one random
    number per position (callers draw them from a counter-based stream). The sample is the
    first index i whose cumulative probability exceeds u: one uniform per position, where an
    exponential race needs V of them (on a CPU the random numbers, not the softmax, would
    dominate). Entropy = lse - sum p * s with s = logits / T, from the same probabilities.
    Ties of the argmax go to the lowest index.
    """
    num_positions, vocab = logits.shape
    result = _results(num_positions, logits.device)
    for rows in _chunks(num_positions, vocab):
        part = _sliced(result, rows)
        probs = _sample_chunk(logits[rows], temperature[rows], part)
        part.sample.copy_(_draw(probs, uniform[rows]))
    return result


def entropy_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Entropy-bound acceptance. entropy: [R, L] fp32; bound: [R] fp32. Returns bool [R, L]:
    positions sorted by entropy (ties by position), accepted while cumulative entropy minus own
    entropy <= the row's bound."""
    sorted_entropy, order = torch.sort(entropy, dim=-1, stable=True)
    before = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy
    accept_sorted = before <= bound[:, None]
    return torch.zeros_like(accept_sorted).scatter(-1, order, accept_sorted)


def soft_embedding(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Self-conditioning signal: softmax(logits / T) @ weight * scale, in weight's dtype.

    logits: [P, V] fp32; temperature, lse: [P] fp32 (lse from `fused_sample`); weight: [V, H]
    (the embedding matrix); scale: sqrt(hidden) as the model rounds it. The probabilities are
    exp(logits / T - lse) in fp32, cast to weight's dtype, then multiplied (fp32 accumulation).
    A few positions at a time, as `fused_sample`: the [chunk, V] probabilities are the only
    temporary of vocabulary size.
    """
    num_positions, vocab = logits.shape
    out = logits.new_empty(num_positions, weight.shape[1], dtype=weight.dtype)
    for rows in _chunks(num_positions, vocab):
        log_probs = logits[rows] / temperature[rows, None] - lse[rows, None]  # [C, V]
        probs = log_probs.clamp_(min=_NEGLIGIBLE_LOG_PROB).exp_()  # see `_softmax_rows`
        F.threshold(probs, _NEGLIGIBLE_PROB, 0.0, inplace=True)
        torch.matmul(probs.to(weight.dtype), weight, out=out[rows])
    return out * torch.tensor(scale, dtype=weight.dtype)


def sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> tuple[SampleResult, torch.Tensor]:
    """`fused_sample` then `soft_embedding` on its `lse`: one denoising step's sampling and
    self-conditioning signal ([P, H] in weight's dtype). The twin computes the probabilities
    once for both (the Triton version runs the two kernels)."""
    num_positions, vocab = logits.shape
    result = _results(num_positions, logits.device)
    soft = logits.new_empty(num_positions, weight.shape[1], dtype=weight.dtype)
    for rows in _chunks(num_positions, vocab):
        part = _sliced(result, rows)
        probs = _sample_chunk(logits[rows], temperature[rows], part)
        torch.matmul(probs.to(weight.dtype), weight, out=soft[rows])
        part.sample.copy_(_draw(probs, uniform[rows]))
    return result, soft * torch.tensor(scale, dtype=weight.dtype)
