"""Between sampling and committing: the grammar of structured-output requests and the
log-probabilities of the tokens that are committed (`engine.structured`, `engine.logprobs`).

Only requests that asked for either pay anything; the step's other rows are untouched.
"""

from __future__ import annotations

import torch

from engine.logprobs import token_logprobs
from engine.request import RequestState
from engine.sampling import Sampled
from engine.types import TokenLogprob


@torch.inference_mode()
def before_sampling(ar: list[RequestState], logits: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """Mask the next-token logits [R_ar, V] of constrained AR requests in place; returns the
    raw logits of the rows whose log-probabilities are wanted (taken before the mask)."""
    raw: dict[int, torch.Tensor] = {}
    if logits is None:
        return raw
    for k, req in enumerate(ar):
        if req.params.logprobs is not None:
            raw[k] = logits[k].clone() if req.constraint is not None else logits[k]
        if req.constraint is not None:
            req.constraint.mask_logits(logits[k])
    return raw


@torch.inference_mode()
def after_sampling(
    denoise: list[RequestState],
    ar: list[RequestState],
    sampled: Sampled,
    denoise_logits: torch.Tensor | None,
    raw_ar: dict[int, torch.Tensor],
) -> tuple[dict[int, list[TokenLogprob]], dict[int, TokenLogprob]]:
    """Advance the grammars (AR tokens consumed; converged canvases repaired in
    `sampled.drafts`) and compute the wanted log-probabilities: per DENOISE row index, one per
    draft position up to the budget; per AR row index, the sampled token's."""
    for k, req in enumerate(ar):
        if req.constraint is not None and not sampled.ar_failed[k]:
            token = req.constraint.commit_ar(sampled.ar_tokens[k], req.remaining)
            sampled.ar_tokens[k] = token
            sampled.ar_failed[k] = token < 0  # the grammar refused its own choice: fail alone
    ar_logprobs = {
        k: token_logprobs(raw_ar[k][None], [sampled.ar_tokens[k]], _top(ar[k]))[0] for k in raw_ar
    }
    denoise_logprobs: dict[int, list[TokenLogprob]] = {}
    for j, req in enumerate(denoise):
        draft = sampled.drafts[j]
        if not sampled.finished[j] or sampled.failed[j] or draft is None:
            continue
        if req.constraint is None and req.params.logprobs is None:
            continue
        assert denoise_logits is not None
        length = len(draft)
        logits = denoise_logits[j * length : (j + 1) * length]
        if req.constraint is not None:
            draft = sampled.drafts[j] = req.constraint.repair(draft, logits, req.remaining)
        if req.params.logprobs is not None:
            kept = draft[: min(length, req.remaining)]
            denoise_logprobs[j] = token_logprobs(logits, kept, _top(req))
    return denoise_logprobs, ar_logprobs


def _top(req: RequestState) -> int:
    return req.params.logprobs or 0
