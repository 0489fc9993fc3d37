"""Log-probabilities of committed tokens, bounded in cost.

Definition (both decoding modes): the log-probability of a token is taken under the model's own
distribution at its position — softmax of the raw logits at temperature 1, before any grammar
mask —, and the top-k list ranks the same distribution.
- AR mode: the usual next-token distribution of the step that sampled the token.
- Diffusion mode: the distribution of the *final* denoising step of the token's canvas (the step
  whose argmax draft was committed), at the token's position in the canvas.
Only the chosen token's value and the top k (k <= 20) leave the device; the vocabulary-sized
temporaries are made a few positions at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.device.cuda import to_device
from engine.types import TokenLogprob

CHUNK_ELEMENTS = 1 << 23  # positions x vocabulary per chunk (32 MiB of fp32)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_k: int) -> list[TokenLogprob]:
    """One `TokenLogprob` per token; logits: [N >= len(tokens), V] raw logits of their
    positions (row i for tokens[i])."""
    num = len(tokens)
    if num == 0:
        return []
    vocab = logits.shape[-1]
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    ids = to_device(np.array(tokens, dtype=np.int64), logits.device)
    chosen_parts, top_v_parts, top_i_parts = [], [], []
    for start in range(0, num, chunk):
        rows = logits[start : min(start + chunk, num)].float()
        lse = torch.logsumexp(rows, dim=-1)
        chosen_parts.append(rows.gather(-1, ids[start : start + rows.shape[0], None])[:, 0] - lse)
        if top_k:
            values, indices = rows.topk(top_k, dim=-1)
            top_v_parts.append(values - lse[:, None])
            top_i_parts.append(indices)
    chosen = torch.cat(chosen_parts).clamp_(max=0.0).tolist()
    if not top_k:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen, strict=True)]
    top_values = torch.cat(top_v_parts).clamp_(max=0.0).tolist()
    top_ids = torch.cat(top_i_parts).tolist()
    return [
        TokenLogprob(t, v, tuple(zip(i, tv, strict=True)))
        for t, v, i, tv in zip(tokens, chosen, top_ids, top_values, strict=True)
    ]
