"""The logits processors of a request: logit_bias, the repetition / frequency / presence
penalties, then the candidate filters (`engine.logits.filters`), applied in that order to the
raw logits of each position it samples, before its temperature (both modes, both numerics).

- logit_bias adds each listed token's bias to its logit (transformers' `SequenceBiasLogitsProcessor`
  with one-token sequences: the same fp32 addition).
- repetition_penalty (transformers' `RepetitionPenaltyLogitsProcessor`, vLLM's): every token
  seen in the prompt or among the committed tokens has its logit divided by the penalty when
  positive, multiplied by it when negative.
- frequency_penalty and presence_penalty (OpenAI's, vLLM's): over the committed (generated)
  tokens only, logit -= frequency * count, then logit -= presence * (count > 0).
The penalties count the tokens committed before the step: an AR token sees every token before
it; a diffusion canvas sees the tokens committed before the canvas, the same at each of its
denoising steps (never the canvas's own draft); a hybrid verify pass, the tokens committed
before the pass, at each of its positions. Neutral values change no logit's bits.

A request's logits are processed in place; rows whose raw logits are read after sampling
(log-probabilities, a grammar's repair: `keeps_raw`) are saved first and restored after
(`preserved`), so the only copies are those rows'.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from engine.device.cuda import to_device
from engine.logits.filters import filter_logits_, top_p_floor
from engine.params import ResolvedParams
from engine.request import RequestState


def filters(params: ResolvedParams) -> bool:
    """top_k, top_p or min_p restricts the candidates."""
    return params.top_k > 0 or params.top_p < 1 or params.min_p > 0


def penalises(params: ResolvedParams) -> bool:
    """A penalty changes some logits."""
    return (
        params.repetition_penalty != 1
        or params.frequency_penalty != 0
        or params.presence_penalty != 0
    )


def processes(params: ResolvedParams) -> bool:
    """Some processor changes the logits: the request's rows go through `process_`."""
    return bool(params.logit_bias) or penalises(params) or filters(params)


def keeps_raw(req: RequestState) -> bool:
    """The request's raw logits are read after sampling (log-probabilities, a grammar)."""
    return req.params.logprobs is not None or req.constraint is not None


@contextmanager
def preserved(rows: Sequence[torch.Tensor]) -> Iterator[None]:
    """Restore these views of a step's logits (each a row's) as they are now on the way out:
    what is processed in place inside stays processed only in the other rows."""
    saved = [row.clone() for row in rows]
    try:
        yield
    finally:
        with torch.inference_mode():  # the step's logits are inference tensors
            for row, raw in zip(rows, saved, strict=True):
                row.copy_(raw)


@contextmanager
def processing(logits: torch.Tensor, length: int, reqs: list[RequestState]) -> Iterator[list[int]]:
    """Yields the rows (indices into `reqs`) whose logits [R * length, V] the caller processes
    in place inside; on the way out the rows that `keeps_raw` are restored."""
    rows = [j for j, req in enumerate(reqs) if processes(req.params)]
    view = logits.view(-1, length, logits.shape[-1])
    with preserved([view[j] for j in rows if keeps_raw(reqs[j])]):
        yield rows


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """What one request's penalties count, on the logits' device: the distinct tokens of the
    prompt and the committed tokens ([U] long), the distinct committed tokens ([G] long) and
    how often each was committed ([G] fp32)."""

    seen: torch.Tensor
    generated: torch.Tensor
    counts: torch.Tensor


@dataclass
class PenaltyTokens:
    """A request's tokens as the penalties count them, brought up to date with the tokens it
    commits (`output_ids` only grows): a step's host work is its newly committed tokens and
    its distinct tokens, not a pass over its whole context; the device tensors are made again
    only when a token was committed since."""

    seen: set[int]
    counted: Counter[int]
    num_output: int = 0
    tensors: TokenCounts | None = None


def token_counts(req: RequestState, device: torch.device) -> TokenCounts:
    """The penalties' inputs of `req` (kept on it: `RequestState.penalty_tokens`)."""
    kept = req.penalty_tokens
    if kept is None:
        kept = req.penalty_tokens = PenaltyTokens(set(req.prompt_ids), Counter())
    new = req.output_ids[kept.num_output :]
    if kept.tensors is not None and not new:
        return kept.tensors
    kept.counted.update(new)
    kept.seen.update(new)
    kept.num_output = len(req.output_ids)
    generated = list(kept.counted)
    kept.tensors = TokenCounts(
        seen=to_device(np.array(sorted(kept.seen), dtype=np.int64), device),
        generated=to_device(np.array(generated, dtype=np.int64), device),
        counts=to_device(np.array([kept.counted[t] for t in generated], dtype=np.float32), device),
    )
    return kept.tensors


Scalar = float | torch.Tensor  # a host number, or a [1] tensor on the logits' device


def add_bias_(logits: torch.Tensor, ids: torch.Tensor, biases: torch.Tensor) -> None:
    """logits [N, V] += bias at the ids [B] (distinct), biases [B] fp32, at every position."""
    logits.index_add_(-1, ids, biases.expand(logits.shape[0], -1))


def penalise_(
    logits: torch.Tensor,
    counts: TokenCounts,
    repetition: Scalar,
    frequency: Scalar,
    presence: Scalar,
) -> None:
    """The penalties (module docstring) on logits [N, V] in place, at every position: only
    the seen tokens' columns are read and written."""
    seen = logits[:, counts.seen]  # [N, U]
    logits[:, counts.seen] = torch.where(seen < 0, seen * repetition, seen / repetition)
    generated = logits[:, counts.generated]  # [N, G]
    generated = generated - frequency * counts.counts
    logits[:, counts.generated] = generated - presence * (counts.counts > 0).float()


@torch.inference_mode()  # the step's logits are inference tensors: written in place
def process_(logits: torch.Tensor, req: RequestState) -> None:
    """One request's processors on its logits [N, V] (positions it samples) in place, with
    its knobs read on the host (exact numerics, hybrid verify passes)."""
    params, device = req.params, logits.device
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        add_bias_(
            logits,
            to_device(np.array(ids, dtype=np.int64), device),
            to_device(np.array(biases, dtype=np.float32), device),
        )
    if penalises(params):
        counts = token_counts(req, device)
        penalise_(
            logits,
            counts,
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
        )
    if filters(params):
        num = logits.shape[0]

        def full(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((num,), value, dtype=dtype, device=device)

        filter_logits_(
            logits,
            full(params.top_k, torch.long),
            full(top_p_floor(params.top_p), torch.float32),
            full(params.min_p, torch.float32),
            params.top_k,
            params.top_p < 1,
            params.min_p > 0,
        )


def processed(req: RequestState, logits: torch.Tensor) -> torch.Tensor:
    """One request's logits [N, V] through its processors: a processed copy, or `logits`
    itself when no processor changes them."""
    if not processes(req.params):
        return logits
    out = logits.clone()
    process_(out, req)
    return out
