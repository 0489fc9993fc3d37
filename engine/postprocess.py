"""Between sampling and committing: the grammar of structured-output requests and the
log-probabilities of the tokens that are committed (`engine.structured`, `engine.logprobs`),
turned into one `TokenResult` or `CanvasResult` per row.

Pure: a grammar advances on a fork of the request's constraint, carried in the result; the
request takes it in the scheduler's update. Only requests that asked for either pay anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logprobs import token_logprobs
from engine.request import RequestState
from engine.sampling import CanvasSample, TokenSample
from engine.types import TokenLogprob
from engine.verify import GRAMMAR_REFUSED, NON_FINITE


@dataclass(frozen=True, slots=True)
class TokenResult:
    """A row that sampled its next token: the token to commit, its log-probability when asked,
    the grammar state after it (when it moved), or the row's error."""

    token: int = -1
    logprobs: list[TokenLogprob] | None = None
    constraint: object | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CanvasResult:
    """A denoising step: whether the canvas converged (or hit the step cap) and after how many
    steps, its argmax draft (finished or asked for; repaired by a grammar), the draft's
    log-probabilities when asked, the grammar state, or the row's error."""

    finished: bool = False
    num_steps: int = 0
    draft: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    constraint: object | None = None
    error: str | None = None


@torch.inference_mode()
def before_sampling(ar: list[RequestState], logits: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """Mask the next-token logits [R_ar, V] (this step's own tensor) of constrained AR requests
    in place; returns the raw logits of the rows whose log-probabilities are wanted (taken
    before the mask)."""
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
def ar_results(
    ar: list[RequestState], sampled: TokenSample, raw: dict[int, torch.Tensor]
) -> list[TokenResult]:
    """Per AR-sampled row: the token to commit (the grammar's choice for constrained
    requests), its log-probability when asked, or the row's error."""
    results = []
    for k, req in enumerate(ar):
        if sampled.failed[k]:
            results.append(TokenResult(error=NON_FINITE))
            continue
        token, constraint = sampled.tokens[k], None
        if req.constraint is not None:
            constraint = req.constraint.fork()
            token = constraint.commit_ar(token, req.remaining)
            if token < 0:
                results.append(TokenResult(error=GRAMMAR_REFUSED))
                continue
        logprobs = [token_logprobs(raw[k][None], [token], _top(req))[0]] if k in raw else None
        results.append(TokenResult(token, logprobs, constraint))
    return results


@torch.inference_mode()
def denoise_results(
    denoise: list[RequestState], sampled: CanvasSample, logits: torch.Tensor | None
) -> list[CanvasResult]:
    """Per DENOISE row: the canvas's progress; a converged draft repaired by the grammar of a
    constrained request, and its log-probabilities (one per position up to the budget) when
    asked."""
    results = []
    for j, req in enumerate(denoise):
        if sampled.failed[j]:
            results.append(CanvasResult(error=NON_FINITE))
            continue
        draft, constraint, logprobs = sampled.drafts[j], None, None
        # A draft that is not committed as it is (hybrid: verified) gets neither here.
        wanted = req.policy.commits_drafts() and (
            req.constraint is not None or req.params.logprobs is not None
        )
        if sampled.finished[j] and draft is not None and wanted:
            assert logits is not None
            length = len(draft)
            rows = logits[j * length : (j + 1) * length]
            if req.constraint is not None:
                constraint = req.constraint.fork()
                draft = constraint.repair(draft, rows, req.remaining)
            if req.params.logprobs is not None:
                logprobs = token_logprobs(rows, draft[: min(length, req.remaining)], _top(req))
        results.append(
            CanvasResult(
                finished=sampled.finished[j],
                num_steps=sampled.num_steps[j],
                draft=draft,
                logprobs=logprobs,
                constraint=constraint,
            )
        )
    return results


def _top(req: RequestState) -> int:
    return req.params.logprobs or 0
