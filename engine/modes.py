"""The decode-mode registry: every question whose answer depends on a request's mode is asked
here, of its `ModePolicy`, and no other module branches on the mode.

A mode says how much context a request needs, which row kind it runs once its prompt is in
(`engine.rows`), whether a canvas starts now or the encoder takes a token first, what a
finished canvas becomes (committed as it is, or verified), whether the encoder's next-token
logits choose what is committed, and what `temperature` means. A new mode is one `register`
call with its policy (and, when it needs one, its row kinds); `tests/unit/test_extension.py`
registers a toy one. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING

from engine.types import FinishReason, Progress, RowEffect, RowKind, TokenLogprob

if TYPE_CHECKING:
    from engine.params import DecodingDefaults, ResolvedParams, SamplingParams
    from engine.request import RequestState

MIN_SCHEDULE_SCALE = 0.01  # temperature 0 in diffusion mode: nearly greedy denoising


class DecodeMode(str, Enum):
    """The built-in modes (a registered mode's name may be any other string)."""

    DIFFUSION = "diffusion"
    AR = "ar"
    HYBRID = "hybrid"  # canvases drafted by diffusion, verified by the encoder (AR) path


def first_cut(
    draft: list[int], budget: int, eos_token_ids: frozenset[int]
) -> tuple[list[int], FinishReason | None]:
    """Cut a committed draft at the first EOS (kept) and at the remaining token budget."""
    for i, token in enumerate(draft[:budget]):
        if token in eos_token_ids:
            return draft[: i + 1], FinishReason.STOP
    if len(draft) >= budget:
        return draft[:budget], FinishReason.LENGTH
    return draft, None


class ModePolicy:
    """A decode mode's answers; the base class's are diffusion's: canvases denoised in
    parallel, each committed as it converges, then encoded."""

    # The row kind a request runs once its prompt is in (`engine.rows.ROW_KINDS`).
    after_prefill: str = RowKind.DENOISE
    # The encoder's next-token logits choose what is committed: the prompt's last chunk
    # samples the first token, nothing rides along with it, and `temperature` is the sampling
    # temperature of those tokens.
    samples_tokens = False

    def context_needed(self, num_prompt: int, max_tokens: int, canvas_length: int) -> int:
        """Positions a request occupies (its pages are reserved for all of them); canvases
        are whole even when cut."""
        return num_prompt + math.ceil(max_tokens / canvas_length) * canvas_length

    def apply_temperature(
        self, params: SamplingParams, defaults: DecodingDefaults
    ) -> SamplingParams:
        """What the request's `temperature` means, folded into its other fields: it scales
        the whole linear schedule (1 = the checkpoint's t_min..t_max, 0 is taken as 0.01:
        nearly greedy denoising); explicit `t_min`/`t_max` are scaled too."""
        if params.temperature is None:
            return params
        scale = max(params.temperature, MIN_SCHEDULE_SCALE)
        t_min = params.t_min if params.t_min is not None else defaults.t_min
        t_max = params.t_max if params.t_max is not None else defaults.t_max
        return replace(params, t_min=t_min * scale, t_max=t_max * scale, temperature=None)

    def token_temperature(self, params: ResolvedParams) -> float:
        """The temperature the encoder's next-token draws use (0: greedy; none here)."""
        return params.temperature if self.samples_tokens else 0.0

    def denoising_steps(self, defaults: DecodingDefaults) -> int:
        """The checkpoint's default `max_denoising_steps` in this mode."""
        return defaults.max_denoising_steps

    def pinned_token(self, req: RequestState) -> int:
        """The token a canvas holds fixed in slot 0, or -1."""
        return -1

    def starts_canvas(self, req: RequestState, drafts: Callable[[RequestState], bool]) -> bool:
        """Between canvases: denoise a canvas now (True) or take one encoder token first.
        `drafts` is the scheduler's draft policy."""
        return True

    def finish_canvas(
        self,
        req: RequestState,
        draft: list[int],
        logprobs: list[TokenLogprob] | None,
        progress: Progress,
    ) -> RowEffect:
        """What a converged canvas's `draft` becomes (`progress`: the denoising row's own):
        cut at EOS and the budget and streamed; its commit pass follows if the request goes
        on."""
        tokens, reason = first_cut(draft, req.remaining, req.params.eos_token_ids)
        if reason is None:
            progress = replace(progress, state=RowKind.COMMIT, draft_to_commit=draft)
        logprobs = logprobs[: len(tokens)] if logprobs is not None else None
        return RowEffect(tokens, logprobs, reason, progress=progress)

    def commits_drafts(self) -> bool:
        """A converged canvas is committed as it is (so its grammar and log-probabilities are
        applied when it converges), not handed to another pass."""
        return True


class Autoregressive(ModePolicy):
    """One token per encoder pass (no canvas)."""

    after_prefill: str = RowKind.AR
    samples_tokens = True

    def context_needed(self, num_prompt: int, max_tokens: int, canvas_length: int) -> int:
        return num_prompt + max_tokens

    def apply_temperature(
        self, params: SamplingParams, defaults: DecodingDefaults
    ) -> SamplingParams:
        """`temperature` is the sampling temperature (absent or 0: greedy)."""
        return params


class Hybrid(Autoregressive):
    """Canvases drafted by diffusion (a few steps), verified by the encoder (`engine.verify`);
    between drafts, when drafting does not pay (`engine.draft_policy`), AR tokens."""

    after_prefill: str = RowKind.DENOISE

    def context_needed(self, num_prompt: int, max_tokens: int, canvas_length: int) -> int:
        # A draft starts at its pending token (the last one committed, not yet encoded), so
        # its last verify pass writes up to canvas_length - 1 positions past the budget.
        return num_prompt + max_tokens - 1 + canvas_length

    def denoising_steps(self, defaults: DecodingDefaults) -> int:
        return defaults.hybrid_draft_steps

    def pinned_token(self, req: RequestState) -> int:
        return req.output_ids[-1] if req.output_ids else -1

    def starts_canvas(self, req: RequestState, drafts: Callable[[RequestState], bool]) -> bool:
        return drafts(req)

    def finish_canvas(
        self,
        req: RequestState,
        draft: list[int],
        logprobs: list[TokenLogprob] | None,
        progress: Progress,
    ) -> RowEffect:
        # The draft goes to its verify pass, starting with the pending token.
        verify = [self.pinned_token(req), *draft[1:]]
        return RowEffect(progress=replace(progress, state=RowKind.VERIFY, draft_to_commit=verify))

    def commits_drafts(self) -> bool:
        return False


MODES: dict[str, ModePolicy] = {
    DecodeMode.DIFFUSION.value: ModePolicy(),
    DecodeMode.AR.value: Autoregressive(),
    DecodeMode.HYBRID.value: Hybrid(),
}


def register(name: str, policy: ModePolicy) -> None:
    """Add a decode mode (requests name it in `SamplingParams.mode`)."""
    if name in MODES:
        raise ValueError(f"decode mode {name!r} is registered already")
    MODES[name] = policy


def policy(mode: str) -> ModePolicy:
    return MODES[mode]


def mode_names() -> tuple[str, ...]:
    return tuple(MODES)
