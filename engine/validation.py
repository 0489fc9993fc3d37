"""The one request validator: a prompt and its `SamplingParams`, against the checkpoint's
defaults and the engine's limits, become the `ResolvedParams` the engine runs with.

Used by the HTTP server and the offline `LLM` alike, so both accept, reject and interpret the
same requests. It holds everything that is not a single field's bound (those are checked when
a `SamplingParams` is built): the mode's meaning of `temperature`, the default token budget,
the context, vocabulary and KV-cache checks, and the bounds of the HTTP-only request fields
(`n`, `stop`). Torch-free. `Engine.add_request` runs the prompt and context checks again, so a
caller that skipped the validator gets the same errors.
"""

from __future__ import annotations

from dataclasses import replace

from engine.modes import policy
from engine.params import DecodingDefaults, ParamError, ResolvedParams, SamplingParams
from engine.types import EngineLimits

MAX_N = 8
MAX_STOP = 4
MAX_STOP_LEN = 256
MAX_USER_LEN = 256


class ContextLengthError(ParamError):
    """Prompt plus completion need more positions than the model has."""

    def __init__(self, limit: int, num_prompt: int, num_completion: int, max_tokens: int) -> None:
        super().__init__(
            "max_tokens",
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs "
            f"{num_prompt + num_completion} positions, more than the model's context of {limit}",
        )
        self.limit = limit
        self.num_prompt = num_prompt
        self.num_completion = num_completion  # positions: whole canvases in diffusion mode


def context_needed(num_prompt: int, params: ResolvedParams, canvas_length: int) -> int:
    """Positions a request occupies (its mode's answer: `ModePolicy.context_needed`)."""
    return policy(params.mode).context_needed(num_prompt, params.max_tokens, canvas_length)


def apply_temperature(params: SamplingParams, defaults: DecodingDefaults) -> SamplingParams:
    """The temperature policy, the same for HTTP and offline callers: what `temperature`
    means in the request's mode (`ModePolicy.apply_temperature`)."""
    return policy(params.mode or defaults.mode).apply_temperature(params, defaults)


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise ParamError("n", f"must be in [1, {MAX_N}]")


def check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP:
        raise ParamError("stop", f"at most {MAX_STOP} stop strings are allowed")
    if any(not s or len(s) > MAX_STOP_LEN for s in stop):
        raise ParamError("stop", f"stop strings must be 1 to {MAX_STOP_LEN} characters")


def check_user(user: str | None) -> None:
    if user is not None and len(user) > MAX_USER_LEN:
        raise ParamError("user", f"must be at most {MAX_USER_LEN} characters")


class RequestValidator:
    """Checks requests against one engine's limits and one checkpoint's defaults."""

    def __init__(self, defaults: DecodingDefaults, limits: EngineLimits) -> None:
        self.defaults = defaults
        self.limits = limits

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> ResolvedParams:
        """The resolved parameters of a request, or ParamError naming what is wrong
        (ContextLengthError when prompt plus completion exceed the model's context)."""
        resolved = self.resolve(len(prompt_ids), params)
        self.check_prompt(prompt_ids, resolved)
        return resolved

    def resolve(self, num_prompt: int, params: SamplingParams) -> ResolvedParams:
        """Apply the temperature policy and the defaults, then check the context and the KV
        cache. Without `max_tokens`: the checkpoint's default, bounded by the whole canvases
        left in the context and the KV cache (so a request that did not send `max_tokens` is
        never refused for it)."""
        if params.max_tokens is None:
            default = self.default_max_tokens(num_prompt, params.mode)
            if default < 1:
                positions = min(self.limits.max_context_positions, self.limits.max_fit_positions)
                raise ParamError(
                    "prompt",
                    f"{num_prompt} tokens leave no room for a completion (the context and the "
                    f"KV cache hold {positions} positions)",
                )
            params = replace(params, max_tokens=default)
        resolved = self.defaults.resolve(apply_temperature(params, self.defaults))
        self.check_context(num_prompt, resolved)
        vocab = self.limits.vocab_size
        if max(params.stop_token_ids, default=0) >= vocab:
            raise ParamError("stop_token_ids", f"token ids must be in [0, {vocab})")
        if resolved.json_schema is not None and (params.ignore_eos or not resolved.eos_token_ids):
            raise ParamError(
                "response_format",
                "structured output ends its document with an end-of-sequence token: it cannot "
                "be combined with ignore_eos (or an empty EOS set)",
            )
        return resolved

    def default_max_tokens(self, num_prompt: int, mode: str | None = None) -> int:
        """The configured default budget (`DecodingDefaults.max_new_tokens`; None: no limit),
        cut to the whole canvases (diffusion; AR needs no whole canvas, but the same bound keeps
        one rule) left in the context and the KV cache, less any canvas `mode` (None: the
        checkpoint's) would need past its budget; 0 when none is left."""
        canvas = self.limits.canvas_length
        positions = min(self.limits.max_context_positions, self.limits.max_fit_positions)
        room = (positions - num_prompt) // canvas * canvas
        limit = self.defaults.max_new_tokens
        budget = room if limit is None else min(limit, room)
        # Hybrid's last verify pass reaches past its budget (`ModePolicy.context_needed`).
        needs = policy(mode or self.defaults.mode).context_needed
        while budget > 0 and needs(num_prompt, budget, canvas) > positions:
            budget -= canvas
        return max(0, budget)

    def check_context(self, num_prompt: int, params: ResolvedParams) -> None:
        limits = self.limits
        needed = context_needed(num_prompt, params, limits.canvas_length)
        if needed > limits.max_context_positions:
            raise ContextLengthError(
                limits.max_context_positions, num_prompt, needed - num_prompt, params.max_tokens
            )
        if needed > limits.max_fit_positions:
            raise ParamError(
                "max_tokens",
                f"{needed} positions do not fit in the KV cache (at most "
                f"{limits.max_fit_positions}; raise --kv-cache-tokens)",
            )

    def check_prompt(self, prompt_ids: list[int], params: ResolvedParams | None = None) -> None:
        """The prompt's token ids (and `params`' logit_bias ids) are in the vocabulary."""
        vocab = self.limits.vocab_size
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab), None) if params else None
        if bad_bias is not None:
            raise ParamError(
                "logit_bias", f"token id {bad_bias} is outside the vocabulary [0, {vocab})"
            )
        if not prompt_ids:
            raise ParamError("prompt", "must contain at least one token")
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
