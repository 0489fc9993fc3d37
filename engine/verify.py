"""Hybrid decoding's acceptance: which tokens of a draft the encoder (the model's AR path)
commits.

A hybrid request has a *pending* token t (sampled by the encoder, its KV not yet written) at
position q. Its next canvas is drafted at [q, q + L) with slot 0 pinned to t; the verify pass
encodes the draft d = [t, d_1, …, d_{L-1}] causally, writing KV at [q, q + L), and its logits at
position q + i are the encoder's next-token distribution p_i for position q + i + 1 given the
prefix and d_1..d_i. Walking i = 0, 1, …: the token for position q + i + 1 is decided from p_i
and the proposal d_{i+1}; while it equals the proposal the walk goes on; the first token that
differs (or the token after the last position, from p_{L-1}) is the verifier's own and ends the
walk. It is the new pending token: its KV is written by the next canvas's verify pass, so no
extra forward is ever run. Every verify pass commits at least one token, as AR would.

The rule per position, with p the distribution AR sampling would draw from (the request's
logits processors (`engine.logits`: with the penalties of the tokens committed before the
pass), then its temperature; a grammar's mask first):
- greedy (temperature 0): the token is argmax p — AR greedy's token, whatever was drafted;
- sampling: speculative sampling with q the drafter's distribution of the proposal. The draft
  is the argmax canvas of the drafter's last step, a deterministic function of the drafter's
  state S (its noise, the prefix), which is independent of the verifier's coins; given S, q is
  the point mass on d_{i+1}. The rule min(1, p/q) is then: accept d_{i+1} with probability
  p(d_{i+1}); otherwise draw from the residual norm(max(0, p - q)) = p without d_{i+1},
  renormalised. So P(token = y | S, prefix) = p(y) for every y: exact, not an approximation;
  and since each proposal's q is fixed by S alone, accepting d_1..d_i leaves position i+1's
  proposal still distributed as q given everything the verifier has seen.
A grammar (structured output) masks p before either rule and then takes the token through
`Constraint.commit_ar` — AR's path — which may replace it (closing a document in budget); a
replaced token differs from the proposal and so ends the walk. Log-probabilities are AR's:
the raw logits at the token's position, before the mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.logits.processors import processed
from engine.logprobs import token_logprobs
from engine.request import RequestState
from engine.types import TokenLogprob

GRAMMAR_REFUSED = "the grammar refused every token (internal engine error)"
NON_FINITE = "the model produced non-finite logits"


@dataclass(frozen=True, slots=True)
class Verified:
    """What a verify pass commits: the accepted proposals, then the verifier's own token
    (`num_accepted` is how many of `tokens` are proposals); their log-probabilities when
    asked, the grammar state after them, or the row's error."""

    tokens: list[int]
    num_accepted: int = 0
    logprobs: list[TokenLogprob] | None = None
    constraint: object | None = None
    error: str | None = None


class Draws(Protocol):
    """A request's random numbers for one verify pass (exact numerics: its generator;
    fast numerics: its counter-based stream at the token's output index)."""

    def coins(self, first_index: int, num: int) -> list[float]:
        """`num` uniform numbers in [0, 1), for output indices first_index.. ."""

    def categorical(self, weights: torch.Tensor, index: int) -> int:
        """A draw from `weights` [V] (non-negative, not necessarily normalised)."""


@torch.inference_mode()
def verify_draft(
    req: RequestState, draft: list[int], logits: torch.Tensor, draws: Draws
) -> Verified:
    """The tokens a verify pass commits (accepted proposals, then the verifier's token) and
    how many proposals were accepted. logits: [L, V] fp32 raw, row i at the draft's position i.
    Pure: a grammar advances on a fork, carried in the result."""
    if not bool(torch.isfinite(torch.logsumexp(logits, -1)).all()):
        return Verified([], error=NON_FINITE)
    params, budget = req.params, req.remaining
    first = len(req.output_ids)  # output index of the first token decided here
    constraint = req.constraint.fork() if req.constraint is not None else None
    greedy = params.temperature <= 0
    chosen = None
    if constraint is None:  # every position's distribution at once
        chosen = _unconstrained_choices(req, draft, logits, draws, first, greedy)
    tokens: list[int] = []
    coins = draws.coins(first, len(draft)) if not greedy and constraint is not None else []
    for i in range(min(len(draft), budget)):
        proposal = draft[i + 1] if i + 1 < len(draft) else None
        if chosen is not None:
            token = chosen(i, proposal)
        else:
            assert constraint is not None
            row = logits[i].clone()
            constraint.mask_logits(row)
            token = _choose(req, row, proposal, coins[i] if coins else 0.0, draws, first + i)
            token = constraint.commit_ar(token, budget - i)
            if token < 0:
                return Verified([], error=GRAMMAR_REFUSED)
        tokens.append(token)
        if token != proposal or token in params.eos_token_ids:
            break
    accepted = sum(1 for _ in _agreeing(tokens, draft))
    logprobs = None
    if params.logprobs is not None:
        logprobs = token_logprobs(logits[: len(tokens)], tokens, params.logprobs)
    return Verified(tokens, accepted, logprobs, constraint)


def _agreeing(tokens: list[int], draft: list[int]) -> list[int]:
    """The committed tokens that are the draft's own (a prefix of `tokens`)."""
    out = []
    for token, proposal in zip(tokens, draft[1:], strict=False):
        if token != proposal:
            break
        out.append(token)
    return out


def _unconstrained_choices(
    req: RequestState,
    draft: list[int],
    logits: torch.Tensor,
    draws: Draws,
    first: int,
    greedy: bool,
) -> Callable[[int, int | None], int]:
    """Without a grammar every position's p is known up front: one argmax (greedy) or one
    softmax and one gather (sampling) for the whole draft. Returns choose(i, proposal)."""
    params, filtered = req.params, processed(req, logits)
    if greedy:
        best = filtered.argmax(-1).tolist()
        return lambda i, proposal: best[i]
    probs = torch.softmax(filtered / params.temperature, dim=-1)  # [L, V]
    proposals = torch.tensor(draft[1:], dtype=torch.long, device=logits.device)
    p_proposal = probs[:-1].gather(-1, proposals[:, None])[:, 0].tolist()  # [L - 1]
    coins = draws.coins(first, len(draft))

    def choose(i: int, proposal: int | None) -> int:
        if proposal is not None and coins[i] < p_proposal[i]:
            return proposal
        return _residual(probs[i], proposal, draws, first + i)

    return choose


def _choose(
    req: RequestState,
    row: torch.Tensor,
    proposal: int | None,
    coin: float,
    draws: Draws,
    index: int,
) -> int:
    """One position's token from its (masked) logits [V]: AR greedy's, or the speculative
    rule's with a point-mass q on `proposal` (module docstring)."""
    params, filtered = req.params, processed(req, row[None])[0]
    if params.temperature <= 0:
        return int(filtered.argmax())
    probs = torch.softmax(filtered / params.temperature, dim=-1)
    if proposal is not None and coin < float(probs[proposal]):
        return proposal
    return _residual(probs, proposal, draws, index)


def _residual(probs: torch.Tensor, proposal: int | None, draws: Draws, index: int) -> int:
    """A draw from p without the rejected proposal (the whole p after the last position)."""
    if proposal is None:
        return draws.categorical(probs, index)
    residual = probs.clone()
    residual[proposal] = 0.0
    return draws.categorical(residual, index)
