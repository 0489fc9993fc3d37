"""Hybrid decoding's draft policy: whether a hybrid request drafts its next canvas or takes one
AR step, from what a draft cycle costs on this device at this load and how much of a draft
the verifier accepts (pure Python, no torch).

A draft cycle runs `max_denoising_steps` decoder passes and one verify pass over a canvas of L
positions and commits accepted + 1 tokens; an AR step commits one. So drafting pays when
accepted + 1 >= (steps + 1) × c, where c is a canvas pass's cost in AR passes for this
request:
- on a memory-bound device (a GPU at small batch) a forward costs about the same for 1 token
  or L, so c ≈ 1;
- on a compute-bound one (a CPU, or a GPU at large batch) the step time grows with its tokens,
  and once many requests share a step the fixed part is shared too: c approaches L.
`StepCost` fits the step time as fixed + per_token × tokens from the engine's own steps, and
gives c = (fixed / n + per_token × L) / (fixed / n + per_token) with n requests running. When
even a draft accepted whole (L tokens committed) could not pay, the request never drafts — not
even a first draft or a probe; that is what keeps a loaded server from slowing down.

A request's acceptance estimate is its own average over its verify passes; before its first,
the average over every request's recent verify passes (the `prior`). When the estimate says
drafting does not pay, the request takes AR steps (its pending token is exactly an AR row's
input, so switching is free) and probes with one draft cycle once it has committed
`probe_every` cycles' worth of AR tokens, so probing costs at most 1 / `probe_every` of AR.

Exact numerics use neither measured costs nor the prior (nor does `adaptive=False`): a
request's decisions then depend only on its own verify passes and `canvas_cost`, so its
sampled text is the same for a seed whatever else runs (greedy text is AR's either way). In
fast numerics a sampled hybrid text may depend on the load, as fast numerics' values already
depend on the batch; its distribution is AR's either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import RequestState

ACCEPT_DECAY = 0.5  # the weight of a request's earlier verify passes in its own average
PRIOR_DECAY = 0.9  # the weight of earlier verify passes (all requests) in the prior


def decayed(average: float | None, value: float, decay: float) -> float:
    """An exponential average after one more value (the value itself when there was none)."""
    return value if average is None else decay * average + (1 - decay) * value


@dataclass(frozen=True, slots=True)
class DraftPolicy:
    canvas_cost: float = 1.0  # c until the step cost is known (exact numerics: always)
    probe_every: int = 16
    adaptive: bool = True  # fast numerics: measured step cost and every request's acceptance

    def __post_init__(self) -> None:
        if self.canvas_cost <= 0 or self.probe_every < 1:
            raise ValueError("canvas_cost must be > 0 and probe_every >= 1")

    def drafts(self, seq: RequestState, canvas_cost: float, prior: float | None = None) -> bool:
        cycle = (seq.params.max_denoising_steps + 1) * canvas_cost
        if seq.canvas_length < cycle:  # a draft accepted whole would not pay
            return False
        estimate = seq.accept_average if seq.accept_average is not None else prior
        if estimate is None or estimate + 1 >= cycle:
            return True
        return seq.tokens_since_draft >= self.probe_every * cycle


class StepCost:
    """Step seconds ≈ fixed + per_token × tokens: a least-squares fit over the engine's steps
    with exponential forgetting (each new step weighs 1, the one before `decay`, …)."""

    def __init__(self, decay: float = 0.98, min_spread: float = 1.0) -> None:
        self.decay, self.min_spread = decay, min_spread
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d, x = self.decay, float(num_tokens)
        self._w = d * self._w + 1
        self._x = d * self._x + x
        self._y = d * self._y + seconds
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until the steps' token counts have
        varied by at least `min_spread` (standard deviation)."""
        if self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < self.min_spread**2:
            return None
        per_token = max(0.0, (self._xy / self._w - mx * my) / var)
        fixed = my - per_token * mx
        if fixed < 0:  # all of it scales with the tokens
            fixed, per_token = 0.0, self._y / max(self._x, 1e-9)
        return fixed, per_token

    def canvas_cost(self, canvas_length: int, num_running: int) -> float | None:
        """A canvas pass's cost in AR passes for one of `num_running` requests sharing a
        step's fixed cost; None while the fit is unknown."""
        fit = self.fit()
        if fit is None:
            return None
        fixed, per_token = fit
        shared = fixed / max(1, num_running)
        if shared + per_token <= 0:
            return None
        return (shared + per_token * canvas_length) / (shared + per_token)
