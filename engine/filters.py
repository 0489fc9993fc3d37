"""top_k / top_p: the candidate tokens of a position, filtered before anything is drawn.

Both numerics use this one function; per position it computes exactly what transformers'
`TopKLogitsWarper` then `TopPLogitsWarper` compute (the same operations, row-independent), so
exact numerics match the reference run with those warpers as its `logits_processor` — which
the reference applies to the raw logits, before its temperature schedule. Canvas does the same
in both modes: the filters see the model's logits at temperature 1, and every later pass
(temperature, sampling, argmax, entropy, self-conditioning) sees the filtered logits.
"""

from __future__ import annotations

import torch


def top_p_floor(top_p: float) -> float:
    """The cumulative-probability floor below which top_p removes tokens: 1 - top_p computed
    in double, as the reference's warper does (then compared in fp32); 0 = off."""
    return 1.0 - top_p


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, floor: torch.Tensor, max_k: int, any_p: bool
) -> torch.Tensor:
    """Filtered copy of logits [N, V]: per position, tokens outside its top_k ([N] long, 0 =
    off), then tokens whose ascending cumulative probability is <= its top_p floor ([N] fp32,
    `top_p_floor`; 0 = off; the most likely token always stays) become -inf. `max_k` (the
    largest top_k) and `any_p` (some floor > 0) come from the host: no device sync."""
    out = logits
    vocab = logits.shape[-1]
    if max_k > 0:
        k = top_k.clamp(max=vocab)
        values = torch.topk(logits, min(max_k, vocab), dim=-1).values  # [N, max_k]
        kth = values.gather(-1, (k.clamp(min=1) - 1)[:, None])  # [N, 1]
        out = out.masked_fill((out < kth) & (k > 0)[:, None], float("-inf"))
    if any_p:
        ordered, index = torch.sort(out, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= floor[:, None]
        remove[..., -1:] = False
        remove = remove.scatter(1, index, remove)
        out = out.masked_fill(remove & (floor > 0)[:, None], float("-inf"))
    return out
