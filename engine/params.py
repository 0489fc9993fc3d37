"""Per-request parameters and the checkpoint's decoding defaults.

`SamplingParams` is what a caller asks for (None = "use the checkpoint default");
`DecodingDefaults` comes from a generation_config.json (`generation_config`: the checkpoint's,
none, or another folder's, with keys set over it); `resolve` merges them into the
fully specified `ResolvedParams` the engine runs with. The decoding knobs the three share are
one record, `DecodingKnobs`, and the maps between them loop over its fields. Each field's
bounds are checked here, when a `SamplingParams` is built, with messages that name the
parameter; `engine.validation` adds what needs the engine (context, vocabulary, KV cache) and
what `temperature` means in the request's mode (`engine.modes`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from engine.modes import DecodeMode, mode_names, policy

MAX_TEMPERATURE = 2.0  # OpenAI's upper bound
MAX_TOP_LOGPROBS = 20  # OpenAI's chat bound (completions: 5, checked by the server)
MODE_NAMES = mode_names()  # the built-in modes (flag choices)


class ParamError(ValueError):
    """An invalid request parameter; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


# The lowest sampling temperature: logits / T must stay far from fp32 overflow (a request with
# T = 1e-45 once turned into NaN and failed every request of its batch).
MIN_TEMPERATURE = 1e-3
# The sampler keeps these in float32 (the batched sampler's slots, the reference's schedule):
# each must be finite there, and the bounds keep every value the schedule derives from them
# (temperature scaling by up to MAX_TEMPERATURE, t_max - t_min) finite too. They are far above
# anything useful: the schedule's temperatures are ~1, and a whole canvas's entropy is at most
# canvas_length * ln(vocabulary) (< 4,000 at 256 x 262,144).
MAX_SCHEDULE_TEMPERATURE = 1e4
MAX_ENTROPY = 1e9
FLOAT_BOUNDS = {
    "entropy_bound": MAX_ENTROPY,
    "t_min": MAX_SCHEDULE_TEMPERATURE,
    "t_max": MAX_SCHEDULE_TEMPERATURE,
    "confidence_threshold": MAX_ENTROPY,
}
MAX_DENOISING_STEPS = 1024
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary; the sampler clamps it to the vocabulary
MAX_STABILITY_THRESHOLD = 64
# vLLM's bounds of the processors' knobs: (low, high, whether low itself is allowed).
PROCESSOR_RANGES = {
    "min_p": (0.0, 1.0, True),
    "repetition_penalty": (0.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, True),
    "presence_penalty": (-2.0, 2.0, True),
}
MAX_LOGIT_BIAS, MAX_BIAS = 300, 100.0  # OpenAI's: entries, and |bias| of each


def _checkpoint_key(default: Any, *path: str) -> Any:
    """A field `DecodingDefaults.from_checkpoint` reads from generation_config.json at `path`
    (keys, outermost first)."""
    return field(default=default, metadata={"generation_config": path})


@dataclass(frozen=True, slots=True)
class DecodingKnobs:
    """The decoding knobs: the one list of what a request may tune about how its tokens are
    chosen, with the reference's global defaults. `ResolvedParams` (a request's values) and
    `DecodingDefaults` (a checkpoint's) are knobs; `SamplingParams` and the server's request
    models carry each as an optional field of the same name (typed for their callers, with its
    bound checked in `SamplingParams`); the batched sampler keeps one slot tensor per knob.
    Every map between them loops over these fields, and tests/unit/test_knobs.py names any
    place a new knob is missing from. Knobs with a generation_config key take the
    checkpoint's value; the others default here."""

    # diffusion (hybrid: `max_denoising_steps` is the draft's steps before verification)
    max_denoising_steps: int = _checkpoint_key(48, "max_denoising_steps")
    entropy_bound: float = _checkpoint_key(0.1, "sampler_config", "entropy_bound")
    t_min: float = _checkpoint_key(0.4, "t_min")
    t_max: float = _checkpoint_key(0.8, "t_max")
    stability_threshold: int = _checkpoint_key(1, "stability_threshold")
    confidence_threshold: float = _checkpoint_key(0.005, "confidence_threshold")  # 0: never early
    # Resolved, the AR sampling temperature (0 = greedy), which diffusion ignores; a request's
    # means what its mode says (engine.validation.apply_temperature).
    temperature: float = 0.0
    # The logits processors, on the raw logits in this order (both modes, `engine.logits`):
    # logit_bias ((token id, bias) pairs, ascending ids), the penalties (over the prompt and the
    # committed tokens: repetition 1, frequency and presence 0 = off), then the candidate
    # filters: the top_k most likely tokens (0: all), the smallest set holding top_p of the
    # probability (1: all), the tokens at least min_p times as likely as the most likely.
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


KNOB_NAMES = tuple(f.name for f in fields(DecodingKnobs))
FLOAT_KNOBS = tuple(f.name for f in fields(DecodingKnobs) if isinstance(f.default, float))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What a request asks for. Fields left None take the checkpoint's defaults."""

    max_tokens: int | None = None
    mode: str | None = None  # a registered mode (`engine.modes`); None: the checkpoint's default
    seed: int | None = None
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] | None = None  # overrides the checkpoint's EOS set
    # More tokens that end the request as an EOS does (committed, a canvas cut at the first),
    # under ignore_eos too (vLLM's stop_token_ids)
    stop_token_ids: tuple[int, ...] = ()
    # The decoding knobs (`DecodingKnobs`, which says what each means), typed here for callers.
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_min: float | None = None
    t_max: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None  # 0 disables the adaptive stop
    # What `temperature` means depends on the mode (`ModePolicy.apply_temperature`):
    # diffusion: scales the t_min..t_max schedule; AR: the sampling temperature, 0 is greedy.
    temperature: float | None = None
    top_k: int | None = None  # None, 0 or -1: all tokens
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # token id (int, or its decimal string as JSON keys are) -> bias; held as DecodingKnobs does
    logit_bias: Mapping[int | str, float] | tuple[tuple[int, float], ...] | None = None
    # Structured output: the text must be a JSON document valid under this JSON schema (a JSON
    # string; '{"type": "object"}' for OpenAI's json_object). Enforced by a grammar per request.
    json_schema: str | None = None
    # Log-probabilities: None = none; k >= 0 = the chosen token's plus the top k (k <= 20).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in FLOAT_KNOBS:  # their ranges are checked below
            value = getattr(self, name)
            _check(value is None or math.isfinite(value), name, "must be a finite number")
            bound = FLOAT_BOUNDS.get(name, math.inf)
            _check(value is None or value <= bound, name, f"must be <= {bound:g}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(min(self.stop_token_ids, default=0) >= 0, "stop_token_ids", "must be token ids")
        _check(
            self.mode is None or self.mode in mode_names(),
            "mode",
            f"must be one of {', '.join(repr(m) for m in mode_names())}",
        )
        if self.mode in MODE_NAMES and not isinstance(self.mode, DecodeMode):
            object.__setattr__(self, "mode", DecodeMode(self.mode))  # one spelling of a built-in
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        _check(
            self.max_denoising_steps is None
            or 1 <= self.max_denoising_steps <= MAX_DENOISING_STEPS,
            "max_denoising_steps",
            f"must be in [1, {MAX_DENOISING_STEPS}]",
        )
        _check(self.entropy_bound is None or self.entropy_bound > 0, "entropy_bound", "must be > 0")
        _check(self.t_min is None or self.t_min >= 0, "t_min", "must be >= 0")
        _check(
            self.t_max is None or self.t_max >= MIN_TEMPERATURE,
            "t_max",
            f"must be >= {MIN_TEMPERATURE:g} (lower temperatures overflow the softmax)",
        )
        _check(
            self.stability_threshold is None
            or 0 <= self.stability_threshold <= MAX_STABILITY_THRESHOLD,
            "stability_threshold",
            f"must be in [0, {MAX_STABILITY_THRESHOLD}]",
        )
        _check(
            self.confidence_threshold is None or self.confidence_threshold >= 0,
            "confidence_threshold",
            "must be >= 0 (0 disables the adaptive stop)",
        )
        _check(
            self.temperature is None or 0 <= self.temperature <= MAX_TEMPERATURE,
            "temperature",
            f"must be in [0, {MAX_TEMPERATURE:g}]",
        )
        _check(
            not self.temperature or self.temperature >= MIN_TEMPERATURE,
            "temperature",
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g} (lower temperatures overflow the "
            "softmax)",
        )
        _check(self.top_p is None or 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        for name, (low, high, closed) in PROCESSOR_RANGES.items():
            value = getattr(self, name)
            inside = value is None or (low <= value if closed else low < value) and value <= high
            _check(inside, name, f"must be in {'[' if closed else '('}{low:g}, {high:g}]")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _check(
            self.top_k is None or -1 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"must be -1 or 0 (all tokens) or in [1, {MAX_TOP_K}]",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedParams(DecodingKnobs):
    """Fully specified decoding parameters of one request: its knobs and the rest."""

    max_tokens: int
    mode: str  # a registered mode (`engine.modes`)
    seed: int | None
    eos_token_ids: frozenset[int]  # what ends it: the EOS set (none: ignore_eos), stop_token_ids
    json_schema: str | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(self.t_max > self.t_min, "t_max", f"must be > t_min ({self.t_max} <= {self.t_min})")


@dataclass(frozen=True, slots=True)
class DecodingDefaults(DecodingKnobs):
    """Defaults from generation_config.json (the keys its fields name); the reference's global
    defaults where it is silent."""

    # None: no server-wide limit, a request without max_tokens may use the rest of the context
    max_new_tokens: int | None = _checkpoint_key(256, "max_new_tokens")
    eos_token_ids: tuple[int, ...] = ()  # `eos_token_id`: one id or a list
    pad_token_id: int | None = _checkpoint_key(None, "pad_token_id")
    mode: str = _checkpoint_key(DecodeMode.DIFFUSION, "canvas_default_mode")
    # Hybrid mode: denoising steps a draft gets before the encoder verifies it (chosen by
    # measuring the default model, see docs/decoding-modes.md).
    hybrid_draft_steps: int = _checkpoint_key(1, "canvas_hybrid_draft_steps")

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        eos_fallback: tuple[int, ...],
        source: str | Path = "auto",
        overrides: Mapping[str, Any] | None = None,
    ) -> DecodingDefaults:
        """The defaults `source` names (`generation_config`), with `overrides` (keys as
        generation_config.json spells them) on top. Raises ParamError naming an unknown key or
        a key whose value is out of its bounds, OSError when a DIR holds no config. Under
        `vllm` no `max_new_tokens` is set unless `overrides` sets one (None: a request without
        max_tokens may use the rest of the context)."""
        raw = _merged(generation_config(model_dir, source), overrides or {})
        values: dict[str, Any] = {}
        for f in fields(cls):
            if "generation_config" in f.metadata:
                values[f.name] = _config_value(raw, f.metadata["generation_config"])
                _check_type(f, values[f.name])
        try:
            values["mode"] = DecodeMode(values["mode"]) if values["mode"] else None
        except ValueError:
            raise ParamError("canvas_default_mode", f"unknown mode {values['mode']!r}") from None
        eos = raw.get("eos_token_id")
        _check(
            eos is None or _is_int(eos) or isinstance(eos, list) and all(map(_is_int, eos)),
            "eos_token_id",
            "must be a token id or a list of token ids",
        )
        values["eos_token_ids"] = (
            (eos,) if isinstance(eos, int) else tuple(eos) if eos else tuple(eos_fallback)
        )
        defaults = cls(**{k: v for k, v in values.items() if v is not None})
        if str(source) == "vllm":
            defaults = replace(defaults, max_new_tokens=raw.get("max_new_tokens"))
        defaults.check()
        return defaults

    def check(self) -> None:
        """Raises ParamError naming the generation_config key whose value is out of bounds
        (the bounds a request's value of the same knob has)."""
        knobs = {name: getattr(self, name) for name in KNOB_NAMES}
        try:
            self.resolve(SamplingParams(max_tokens=1, **knobs))
        except ParamError as exc:
            key = ".".join(_knob_keys().get(exc.param, (exc.param,)))
            raise ParamError(key, str(exc).removeprefix(f"{exc.param}: ")) from None
        _check(
            self.max_new_tokens is None or self.max_new_tokens >= 1,
            "max_new_tokens",
            "must be >= 1",
        )
        _check(self.hybrid_draft_steps >= 1, "canvas_hybrid_draft_steps", "must be >= 1")

    def resolve(self, params: SamplingParams) -> ResolvedParams:
        """Each knob `params` leaves None takes this checkpoint's value; float knobs become
        floats, and top_k -1 (vLLM's "all") becomes 0."""
        eos = params.eos_token_ids if params.eos_token_ids is not None else self.eos_token_ids
        mode = params.mode if params.mode is not None else self.mode
        # The mode's default denoising steps (hybrid: the draft's, before verification).
        defaults = replace(self, max_denoising_steps=policy(mode).denoising_steps(self))
        knobs: dict[str, Any] = {}
        for name in KNOB_NAMES:
            value = getattr(params, name)
            value = getattr(defaults, name) if value is None else value
            knobs[name] = float(value) if name in FLOAT_KNOBS else value
        knobs["top_k"] = max(0, knobs["top_k"])
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_new_tokens
        if max_tokens is None:
            raise ParamError("max_tokens", "required: no max_new_tokens is configured")
        return ResolvedParams(
            max_tokens=max_tokens,
            mode=mode,
            seed=params.seed,
            eos_token_ids=frozenset(() if params.ignore_eos else eos) | set(params.stop_token_ids),
            json_schema=params.json_schema,
            logprobs=params.logprobs,
            **knobs,
        )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit_bias as (token id, bias) pairs in ascending ids; ParamError unless it maps at
    most MAX_LOGIT_BIAS token ids (ints or decimal strings) to numbers in [-MAX_BIAS,
    MAX_BIAS]. Whether the ids are in the vocabulary is `engine.validation`'s to check."""
    pairs = list(value.items() if isinstance(value, Mapping) else value)
    _check(len(pairs) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} token ids")
    out: dict[int, float] = {}
    for key, bias in pairs:
        ok = _is_int(key) and key >= 0 or isinstance(key, str) and key.isascii() and key.isdigit()
        _check(ok, "logit_bias", f"keys must be token ids, not {key!r}")
        number = (_is_int(bias) or isinstance(bias, float)) and math.isfinite(bias)
        bound = f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]"
        _check(number and abs(bias) <= MAX_BIAS, "logit_bias", f"biases must be in {bound}")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def _config_value(raw: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path` in a generation_config (None where a key or section is absent)."""
    *sections, key = path
    for section in sections:
        raw = raw.get(section) or {}
    return raw.get(key)


GENERATION_CONFIG = "generation_config.json"
# `--generation-config`'s named sources (anything else is a directory).
GENERATION_SOURCES = ("auto", "canvas", "vllm")
# The generation_config.json keys `canvas` and `vllm` (no generation config) still take from the
# checkpoint: the engine needs its end-of-sequence and padding ids, and the default mode and
# hybrid draft steps say how Canvas decodes this checkpoint rather than how it samples.
KEPT_KEYS = ("eos_token_id", "pad_token_id", "canvas_default_mode", "canvas_hybrid_draft_steps")


def generation_config(model_dir: str | Path, source: str | Path = "auto") -> dict[str, Any]:
    """The generation config `source` names: `auto`, the checkpoint's generation_config.json
    (none: {}); `canvas` and `vllm`, none but the checkpoint's KEPT_KEYS (Canvas's defaults for
    the rest; `vllm` also drops `max_new_tokens`, in `DecodingDefaults.from_checkpoint`); a
    directory, the generation_config.json there (OSError when it holds none)."""
    if str(source) not in GENERATION_SOURCES:
        path = Path(source) / GENERATION_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"generation config: no {GENERATION_CONFIG} in {source}")
        return _read_config(path)
    path = Path(model_dir) / GENERATION_CONFIG
    raw = _read_config(path) if path.is_file() else {}
    if str(source) != "auto":
        raw = {key: raw[key] for key in KEPT_KEYS if key in raw}
    return raw


def _read_config(path: Path) -> dict[str, Any]:
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    return raw


def _knob_keys() -> dict[str, tuple[str, ...]]:
    """Each checkpoint field's generation_config key path, by field name."""
    return {
        f.name: f.metadata["generation_config"]
        for f in fields(DecodingDefaults)
        if "generation_config" in f.metadata
    }


def _merged(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with `overrides` set (sections merged key by key); ParamError names an override
    key Canvas does not read."""
    paths = {*_knob_keys().values(), ("eos_token_id",)}
    known = ", ".join(sorted(".".join(p) for p in paths))
    merged = dict(raw)
    for key, value in overrides.items():
        inner = {p[1] for p in paths if len(p) == 2 and p[0] == key}
        if inner:
            _check(isinstance(value, Mapping), key, "must be a JSON object")
            for sub in value:
                _check(sub in inner, f"{key}.{sub}", f"unknown generation config key ({known})")
            merged[key] = {**(raw.get(key) or {}), **value}
        else:
            _check((key,) in paths, key, f"unknown generation config key ({known})")
            merged[key] = value
    return merged


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(f: Field[Any], value: Any) -> None:
    """ParamError naming the key when a generation_config value has the wrong JSON type."""
    if value is None:
        return
    key = ".".join(f.metadata["generation_config"])
    if isinstance(f.default, float):
        _check(_is_int(value) or isinstance(value, float), key, "must be a number")
    elif isinstance(f.default, str):
        _check(isinstance(value, str), key, "must be a string")
    else:
        _check(_is_int(value), key, "must be an integer")
