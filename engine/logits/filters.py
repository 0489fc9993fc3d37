"""top_k / top_p / min_p: the candidate tokens of a position, filtered before anything is drawn.

Both numerics use this one function; per position it computes exactly what transformers'
`TopKLogitsWarper`, `TopPLogitsWarper` then `MinPLogitsWarper` compute (the same operations,
row-independent), so exact numerics match the reference run with those warpers in its
`logits_processor` — which the reference applies to the raw logits, before its temperature
schedule. Canvas does the same in both modes: the filters see the model's logits at
temperature 1 (after `engine.logits.processors`' bias and penalties), and every later pass
(temperature, sampling, argmax, entropy, self-conditioning) sees the filtered logits.

The logits are filtered in place, FILTER_CHUNK_ELEMENTS at a time: the transient memory is
that of one chunk, never a copy of the step's logits. top_k alone takes a `torch.topk` of the
largest k asked and a threshold; only top_p sorts the vocabulary.
"""

from __future__ import annotations

import torch

# Positions x vocabulary filtered at once: bounds the transients (top_p's sort, its softmax
# and cumulative sums, the masks: about 25 bytes an element, ~0.4 GiB) whatever the batch.
FILTER_CHUNK_ELEMENTS = 1 << 24


def top_p_floor(top_p: float) -> float:
    """The cumulative-probability floor below which top_p removes tokens: 1 - top_p computed
    in double, as the reference's warper does (then compared in fp32); 0 = off."""
    return 1.0 - top_p


def filter_logits_(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    floor: torch.Tensor,
    min_p: torch.Tensor,
    max_k: int,
    any_p: bool,
    any_min_p: bool,
) -> None:
    """Filter logits [N, V] in place: per position, tokens outside its top_k ([N] long, 0 =
    off), then tokens whose ascending cumulative probability is <= its top_p floor ([N] fp32,
    `top_p_floor`; 0 = off; the most likely token always stays), then tokens less likely than
    its min_p ([N] fp32; 0 = off) times the most likely one become -inf. `max_k` (the largest
    top_k), `any_p` (some floor > 0) and `any_min_p` (some min_p > 0) come from the host: no
    device sync."""
    num_positions, vocab = logits.shape
    chunk = max(1, FILTER_CHUNK_ELEMENTS // max(vocab, 1))
    for p0 in range(0, num_positions, chunk):
        rows = slice(p0, p0 + chunk)
        x = logits[rows]  # a view: written in place
        if max_k > 0:
            k = top_k[rows].clamp(max=vocab)
            values = torch.topk(x, min(max_k, vocab), dim=-1).values  # [C, max_k]
            kth = values.gather(-1, (k.clamp(min=1) - 1)[:, None])  # [C, 1]
            x.masked_fill_((x < kth) & (k > 0)[:, None], float("-inf"))
        if any_p:
            ordered, index = torch.sort(x, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= floor[rows, None]
            remove[..., -1:] = False
            remove = remove.scatter(1, index, remove)
            x.masked_fill_(remove & (floor[rows] > 0)[:, None], float("-inf"))
        if any_min_p:  # min_p 0 removes nothing: no probability is below 0
            probs = x.softmax(dim=-1)
            x.masked_fill_(probs < min_p[rows, None] * probs.amax(-1, keepdim=True), float("-inf"))
