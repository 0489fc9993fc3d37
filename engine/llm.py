"""Offline entry point: `LLM.from_pretrained(path).generate(prompts, params)`.

Runs each request on its own (batch size 1), with a private generator, which is exactly the
setting in which Canvas reproduces the reference `generate()` token for token. The serving
engine batches many requests per forward pass on top of the same model, sampler and commit
rules.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model import DenseKVCache, DiffusionGemma, ForwardBatch, Mode, load_model
from engine.params import DecodeMode, DecodingDefaults, ParamError, ResolvedParams, SamplingParams
from engine.sampler import CanvasState, denoise_update, start_canvas
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One finished request. `output_ids` ends with the EOS token when one was generated."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    decoder_passes: int  # denoising steps, all canvases together (AR mode: 0)
    encoder_passes: int  # prefill + commit passes (AR mode: one per token)
    steps_per_canvas: list[int]
    seconds: float

    @property
    def tokens_per_forward(self) -> float:
        passes = self.decoder_passes or self.encoder_passes
        return len(self.output_ids) / passes if passes else 0.0


@dataclass(frozen=True, slots=True)
class Committed:
    """What a finished canvas contributes: tokens cut at EOS and budget, and why it ended."""

    tokens: list[int]
    finish_reason: str | None  # None: the request continues with another canvas


def commit_canvas(draft: list[int], budget: int, eos_token_ids: frozenset[int]) -> Committed:
    """Cut a committed draft at the first EOS (kept) and at the remaining token budget."""
    for i, token in enumerate(draft[:budget]):
        if token in eos_token_ids:
            return Committed(draft[: i + 1], "stop")
    if len(draft) >= budget:
        return Committed(draft[:budget], "length")
    return Committed(draft, None)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


class LLM:
    def __init__(
        self, model: DiffusionGemma, tokenizer: Tokenizer | None, defaults: DecodingDefaults
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.defaults = defaults
        self.canvas_length = model.config.canvas_length
        self.device = model.embed_tokens.weight.device

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, dtype: str = "auto", device: str = "cpu"
    ) -> LLM:
        model = load_model(model_dir, dtype=dtype, device=device)
        has_tokenizer = any(
            (Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")
        )
        tokenizer = Tokenizer(model_dir) if has_tokenizer else None
        defaults = DecodingDefaults.from_checkpoint(model_dir, model.cfg.eos_token_ids)
        return cls(model, tokenizer, defaults)

    # -- public API ------------------------------------------------------------------------------

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) and return the outputs in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        resolved = self.defaults.resolve(params or SamplingParams())
        return [self._run(self.prompt_ids(p), resolved) for p in prompts]  # type: ignore[arg-type]

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this checkpoint has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.check_prompt(ids)
        return ids

    def check_prompt(self, ids: list[int]) -> None:
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise ParamError("prompt", "must contain at least one token")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")

    def context_needed(self, num_prompt: int, params: ResolvedParams) -> int:
        """Positions a request occupies: diffusion canvases are whole even when cut."""
        if params.mode is DecodeMode.AR:
            return num_prompt + params.max_tokens
        return num_prompt + math.ceil(params.max_tokens / self.canvas_length) * self.canvas_length

    # -- one request -------------------------------------------------------------------------------

    def _run(self, prompt: list[int], params: ResolvedParams) -> RequestOutput:
        limit = self.model.cfg.max_position_embeddings
        needed = self.context_needed(len(prompt), params)
        if needed > limit:
            raise ParamError(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs {needed} "
                f"positions, more than the model's context of {limit}",
            )
        start = time.perf_counter()
        cache = DenseKVCache(
            self.model.cfg, 1, needed, self.model.embed_tokens.weight.dtype, self.device
        )
        gen = make_generator(params.seed, self.device)
        with torch.inference_mode():
            prefill_logits = self._encode(prompt, 0, cache)
            if params.mode is DecodeMode.AR:
                out = self._run_ar(prompt, params, cache, gen, prefill_logits)
            else:
                out = self._run_diffusion(prompt, params, cache, gen)
        tokens, reason, decoder_passes, encoder_passes, steps = out
        text = self.tokenizer.decode(tokens) if self.tokenizer else ""
        return RequestOutput(
            prompt_ids=prompt,
            output_ids=tokens,
            text=text,
            finish_reason=reason,
            decoder_passes=decoder_passes,
            encoder_passes=encoder_passes,
            steps_per_canvas=steps,
            seconds=time.perf_counter() - start,
        )

    def _batch(self, mode: Mode, start: int, num: int) -> ForwardBatch:
        return ForwardBatch(
            mode=mode,
            slots=torch.zeros(1, dtype=torch.long, device=self.device),
            start_pos=torch.tensor([start], device=self.device),
            num_tokens=torch.tensor([num], device=self.device),
            sliding_window=self.model.cfg.sliding_window,
        )

    def _encode(self, ids: list[int], start: int, cache: DenseKVCache) -> torch.Tensor:
        """Encoder pass over `ids` at positions start.. ; returns the last position's logits [V]."""
        tokens = torch.tensor([ids], device=self.device)
        hidden = self.model.encode(tokens, self._batch(Mode.ENCODE, start, len(ids)), cache)
        return self.model.logits(hidden[0, -1])

    def _run_diffusion(
        self, prompt: list[int], params: ResolvedParams, cache: DenseKVCache, gen: torch.Generator
    ) -> tuple[list[int], str, int, int, list[int]]:
        model, length = self.model, self.canvas_length
        tokens: list[int] = []
        steps: list[int] = []
        encoder_passes = 1
        while True:
            prefix = len(prompt) + len(steps) * length
            state = start_canvas(params, model.cfg.vocab_size, length, gen, self.device)
            batch = self._batch(Mode.DECODE, prefix, length)
            while not state.finished:
                self._denoise(state, params, batch, cache)
            steps.append(state.num_steps)
            assert state.argmax is not None
            draft = state.argmax.tolist()
            committed = commit_canvas(draft, params.max_tokens - len(tokens), params.eos_token_ids)
            tokens += committed.tokens
            if committed.finish_reason is not None:
                return tokens, committed.finish_reason, sum(steps), encoder_passes, steps
            self._encode(draft, prefix, cache)  # commit pass: the canvas enters the KV cache
            encoder_passes += 1

    def _denoise(
        self, state: CanvasState, params: ResolvedParams, batch: ForwardBatch, cache: DenseKVCache
    ) -> None:
        model = self.model
        soft = state.soft_embeds[None] if state.soft_embeds is not None else None
        logits = model.logits(model.decode(state.canvas[None], soft, batch, cache))
        scaled, probs = denoise_update(logits, [state], [params])
        state.soft_embeds = model.soft_embed(scaled, probs)[0]

    def _run_ar(
        self,
        prompt: list[int],
        params: ResolvedParams,
        cache: DenseKVCache,
        gen: torch.Generator,
        logits: torch.Tensor,
    ) -> tuple[list[int], str, int, int, list[int]]:
        """Token-by-token decoding from the encoder's logits (greedy when temperature is 0)."""
        tokens: list[int] = []
        passes = 1
        while True:
            if params.temperature > 0:
                probs = torch.softmax(logits / params.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=gen))
            else:
                token = int(logits.argmax())
            tokens.append(token)
            if token in params.eos_token_ids:
                return tokens, "stop", 0, passes, []
            if len(tokens) >= params.max_tokens:
                return tokens, "length", 0, passes, []
            logits = self._encode([token], len(prompt) + len(tokens) - 1, cache)
            passes += 1
