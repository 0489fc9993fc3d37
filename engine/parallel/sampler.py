"""The fused diffusion sampler sharded over the vocabulary: `ShardedSampler` gives what
`kernels.reference`'s `fused_sample` and `sample_and_embed` give over the whole logits, from
each rank's columns of them (its vocabulary-parallel head's slice) and its embedding rows,
plus the AR paths (`argmax`, `sample_ar`: `engine.batched_sampler.BatchedSampler.sample_ar`'s
contract).

Per position, each rank reduces its slice to three fp32 statistics of s = logits / T: its
maximum m_r, z_r = sum exp(s - m_r) and a_r = sum exp(s - m_r) (s - m_r) (the reference's
numerics: exponents clamped at -70, probabilities below e^-70 of the maximum zero). One
all-gather gives every rank all of them, and every rank combines them identically (same
values, same order): the global maximum M, the normaliser sum exp(m_r - M) z_r, the entropy
and the log-normaliser, each shard's probability mass q_r. The one uniform number of a
position falls in one shard's interval [q_0 + ... + q_(r-1), ... + q_r): that rank walks its
slice's cumulative probabilities to the token, and one sum-reduce of the picked ids (0 from
every other rank) gives it to all, with the argmax (the lowest-ranked shard holding the
maximum: ties go to the lowest index, as on one device). The soft embedding is the rank's
probabilities times its embedding rows, all-reduced. Collective payload: O(positions) for the
sampler, [positions, hidden] for the soft embedding; nothing of vocabulary size.

Results equal one device's within fp32 rounding: the sums are taken in another order, so a
token can differ only where the uniform number falls within rounding of a CDF boundary.
top_k / top_p / min_p need a threshold over the whole vocabulary (a sharded search, not
built): serving computes their mask on rank 0 from the rows it gathers whole, and every rank
applies its columns of it (`RowEdit`).

A request's logits processors (`engine.logits.processors`) act per token, so each rank applies
them to its own columns (`apply_edits_`): logit_bias at the ids in its slice, the penalties at
the seen tokens in its slice, and a mask of the allowed tokens (a grammar's, or the filters')
at its columns: the values equal the whole row's processed columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.logits.processors import TokenCounts, add_bias_, penalise_
from engine.parallel.world import World
from kernels.reference import SampleResult

# Statistics all-gathered per position and rank (fp32): m_r, z_r, a_r.
NUM_STATS = 3
# Ids all-reduced per position (int64): the sampled token and the argmax.
NUM_IDS = 2
# As the one-device twin (kernels.reference_sampler): probabilities below e^-70 of the largest
# are 0, and a chunk of positions bounds the [chunk, vocabulary slice] fp32 temporaries.
NEGLIGIBLE_LOG_PROB = -70.0
NEGLIGIBLE_PROB = 4.3e-31  # just above e^-70
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class RowEdit:
    """One request's logits processors over rows [first, first + count) of a sampling call,
    on the whole vocabulary's ids (each rank takes its slice: `apply_edits_`): logit_bias
    (`bias_ids` [B] long, `biases` [B] fp32), the penalties (`counts`, and their [1] fp32
    factors), and the allowed tokens (`allowed`: [count, ceil(V / 8)] uint8, bits packed
    big-endian as `pack_mask`; None: every token)."""

    first: int
    count: int
    bias_ids: torch.Tensor | None = None
    biases: torch.Tensor | None = None
    counts: TokenCounts | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    allowed: torch.Tensor | None = None


def pack_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Bool [N, V] as bits [N, ceil(V / 8)] uint8 on the host (an eighth of the bytes)."""
    return torch.from_numpy(np.packbits(allowed.cpu().numpy(), axis=-1))


def unpack_mask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """`pack_mask`'s inverse: bool [N, vocab] on bits' device."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=bits.device)
    return ((bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :vocab]


def _in_slice(ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return (ids >= start) & (ids < stop)


@torch.inference_mode()  # the step's logits are inference tensors: written in place
def apply_edits_(logits: torch.Tensor, start: int, vocab: int, edits: list[RowEdit]) -> None:
    """Apply `edits` to this rank's columns [P, V_r] of vocabulary ids [start, start + V_r)
    in place (`vocab`: the whole vocabulary's size), in `engine.logits.batched`'s order: the
    bias, the penalties, then the mask (-inf outside it). Each column gets what the whole
    row's would."""
    stop = start + logits.shape[1]
    for edit in edits:
        rows = logits[edit.first : edit.first + edit.count]
        if edit.bias_ids is not None and edit.biases is not None:
            mine = _in_slice(edit.bias_ids, start, stop)
            add_bias_(rows, edit.bias_ids[mine] - start, edit.biases[mine])
        if edit.counts is not None:
            seen, generated = edit.counts.seen, edit.counts.generated
            kept = _in_slice(generated, start, stop)
            local = TokenCounts(
                seen=seen[_in_slice(seen, start, stop)] - start,
                generated=generated[kept] - start,
                counts=edit.counts.counts[kept],
            )
            assert edit.repetition is not None and edit.frequency is not None
            assert edit.presence is not None
            penalise_(rows, local, edit.repetition, edit.frequency, edit.presence)
        if edit.allowed is not None:
            allowed = unpack_mask(edit.allowed, vocab)[:, start:stop]
            rows.masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True, slots=True)
class Combined:
    """Every shard's statistics combined, the same on every rank. Per position [P]: the
    global maximum `top` of s, `lse`, `entropy`, the uniform's `target` in cumulative
    probability; the rank whose interval holds it (`chosen`) and the lowest rank holding the
    maximum (`winner`), int64; `offset`: this rank's cumulative probability before its slice;
    `total`: the normaliser sum exp(s - top)."""

    top: torch.Tensor
    total: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor
    target: torch.Tensor
    offset: torch.Tensor
    chosen: torch.Tensor
    winner: torch.Tensor


class ShardedSampler:
    """The sampler of rank `world.rank`, which holds the logits' columns (and embedding rows)
    of vocabulary ids [vocab_start, vocab_start + V_r), V_r >= 1; the ranks' slices tile the
    vocabulary in rank order. Every rank calls each method with the same positions,
    temperatures and uniform numbers (slot state and Philox replicated) and gets the same
    results."""

    def __init__(self, world: World, vocab_start: int) -> None:
        self.world, self.vocab_start = world, vocab_start

    # -- the kernels' contracts ---------------------------------------------------------------

    def fused_sample(
        self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
    ) -> SampleResult:
        """`kernels.reference.fused_sample` of the whole logits, from this rank's columns
        [P, V_r] fp32; temperature [P] (> 0), uniform [P] in [0, 1)."""
        return self._sample(logits, temperature, uniform, None)[0]

    def sample_and_embed(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
        weight: torch.Tensor,
        scale: float,
    ) -> tuple[SampleResult, torch.Tensor]:
        """`kernels.reference.sample_and_embed`, from this rank's columns of the logits and its
        embedding rows `weight` [V_r, H]: the soft embedding [P, H] in weight's dtype."""
        result, soft = self._sample(logits, temperature, uniform, weight)
        assert soft is not None
        return result, soft * torch.tensor(scale, dtype=weight.dtype)

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens [P] of the whole logits from this rank's columns (ties: the lowest
        id) and failed [P] int64 (1 where the logits are not all finite enough for a
        logsumexp: a NaN, a +inf, or every logit -inf)."""
        self._check(logits)
        top, local = logits.max(dim=-1)  # [P] each: first index of the maximum
        tops = self.world.all_gather(top[None].contiguous(), dim=0)  # [W, P]
        best = tops.max(dim=0).values  # NaN if any rank's is
        winner = (tops == best).to(torch.uint8).argmax(dim=0)  # the lowest such rank
        mine = winner == self.world.rank
        ids = self.world.all_reduce(torch.where(mine, local + self.vocab_start, 0))
        return ids, (~torch.isfinite(best)).long()

    def sample_ar(
        self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next AR tokens [P] from this rank's columns: the argmax where temperature <= 0,
        else a draw at the temperature with `uniform`; and failed [P] int64 (a non-finite
        log-normaliser), as `BatchedSampler.sample_ar`."""
        greedy = temperature <= 0
        result = self.fused_sample(logits, torch.where(greedy, 1.0, temperature), uniform)
        tokens = torch.where(greedy, result.argmax, result.sample)
        return tokens, (~torch.isfinite(result.lse)).long()

    # -- the steps ----------------------------------------------------------------------------

    def _check(self, logits: torch.Tensor) -> None:
        if logits.dim() != 2 or logits.shape[1] < 1:
            raise ValueError(f"logits must be [positions, V_r >= 1], got {list(logits.shape)}")

    def _sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
        weight: torch.Tensor | None,
    ) -> tuple[SampleResult, torch.Tensor | None]:
        """The sample (and with `weight`, the soft embedding before its scale): local
        statistics, their all-gather, the local pick and product, two all-reduces."""
        self._check(logits)
        num_positions, vocab = logits.shape
        stats = logits.new_empty(num_positions, NUM_STATS)  # [P, 3] fp32
        local_argmax = torch.empty(num_positions, dtype=torch.long, device=logits.device)
        chunks = _chunks(num_positions, vocab)
        for rows in chunks:
            stats[rows], local_argmax[rows] = _local_stats(logits[rows], temperature[rows])
        gathered = self.world.all_gather(stats[None], dim=0)  # [W, P, 3]
        comb = _combine(gathered, uniform, self.world.rank)
        picked = torch.empty(num_positions, dtype=torch.long, device=logits.device)
        soft = None
        if weight is not None:
            soft = logits.new_empty(num_positions, weight.shape[1], dtype=weight.dtype)
        for rows in chunks:
            scaled = logits[rows] / temperature[rows, None]  # [C, V_r]
            probs = _probs_(scaled, comb.top[rows], comb.total[rows])
            if soft is not None and weight is not None:
                torch.matmul(probs.to(weight.dtype), weight, out=soft[rows])
            picked[rows] = _pick(probs, comb.offset[rows], comb.target[rows])
        rank = self.world.rank
        ids = torch.stack(
            [
                torch.where(comb.chosen == rank, picked + self.vocab_start, 0),
                torch.where(comb.winner == rank, local_argmax + self.vocab_start, 0),
            ]
        )  # [2, P]
        ids = self.world.all_reduce(ids)
        if soft is not None:
            soft = self.world.all_reduce(soft)
        result = SampleResult(sample=ids[0], argmax=ids[1], entropy=comb.entropy, lse=comb.lse)
        return result, soft


def _chunks(num_positions: int, vocab: int) -> list[slice]:
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    return [slice(p0, p0 + chunk) for p0 in range(0, num_positions, chunk)]


def _local_stats(
    logits: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Of a chunk's columns [C, V_r]: (m, z, a) [C, 3] fp32 of s = logits / T as the module's
    docstring defines them, and the local argmax [C] (first index of the maximum)."""
    scaled = logits / temperature[:, None]  # [C, V_r]
    top, argmax = scaled.max(dim=-1)
    shifted = (scaled - top[:, None]).clamp_(min=NEGLIGIBLE_LOG_PROB)
    exp = shifted.exp()
    F.threshold(exp, NEGLIGIBLE_PROB, 0.0, inplace=True)
    return torch.stack([top, exp.sum(-1), (exp * shifted).sum(-1)], dim=-1), argmax


def _combine(gathered: torch.Tensor, uniform: torch.Tensor, rank: int) -> Combined:
    """Every rank's statistics [W, P, 3] combined (the same arithmetic on every rank)."""
    m, z, a = gathered.unbind(-1)  # [W, P] each
    top = m.max(dim=0).values  # [P], NaN if any rank's is
    gap = m - top  # [W, P], <= 0
    # A shard whose maximum is below e^-70 of the global one holds only zero probabilities
    # (its z and a are NaN where its whole slice is -inf: never read).
    kept = gap >= NEGLIGIBLE_LOG_PROB
    mass = torch.where(kept, gap.exp() * z, 0.0)  # sum exp(s - top) over each shard's slice
    total = mass.sum(0)
    # sum exp(s - top) (s - top) = sum_r exp(gap) (a_r + gap z_r)
    moment = torch.where(kept, gap.exp() * (a + gap * z), 0.0).sum(0)
    log_z = total.log()
    share = mass / total[None]  # [W, P]: each shard's probability mass
    cumulative = share.cumsum(0)
    target = uniform * cumulative[-1]
    hit = cumulative > target[None]
    # Rounding can leave the target unmet: the last shard with any mass then takes it.
    last = (share.shape[0] - 1) - (share > 0).flip(0).to(torch.uint8).argmax(dim=0)
    chosen = torch.where(hit.any(0), hit.to(torch.uint8).argmax(dim=0), last)
    return Combined(
        top=top,
        total=total,
        lse=top + log_z,
        entropy=(log_z - moment / total).clamp_(min=0),
        target=target,
        offset=cumulative[rank] - share[rank],
        chosen=chosen,
        winner=(m == top[None]).to(torch.uint8).argmax(dim=0),
    )


def _probs_(scaled: torch.Tensor, top: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The probabilities [C, V_r] of a chunk's slice of s (overwritten): exp(s - top) / total,
    zero below e^-70 as on one device."""
    scaled -= top[:, None]
    probs = scaled.clamp_(min=NEGLIGIBLE_LOG_PROB).exp_()
    F.threshold(probs, NEGLIGIBLE_PROB, 0.0, inplace=True)
    return probs.div_(total[:, None])


def _pick(probs: torch.Tensor, offset: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The local index [C] whose cumulative probability (after `offset`) first exceeds
    `target` (in place: `probs` becomes its cumulative sums); where rounding leaves it unmet,
    the slice's last token with a non-zero probability. Meaningful on the chosen rank only."""
    cdf = probs.cumsum_(dim=-1).add_(offset[:, None])
    found = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    # the first index at which the cumulative sum reaches its end: the last one it grew at
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)[:, 0]
    return torch.where(found < probs.shape[1], found, last)
