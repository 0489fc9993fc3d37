"""Offline entry point: `LLM.from_pretrained(path).generate(prompts, params)`.

Submits every prompt to the engine and steps it until all are done: the same scheduler,
runner and sampler the server uses, batched. One prompt at a time on CPU reproduces the
reference `generate()` token for token for the same seed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.build import BuildConfig, Checkpoint, CheckpointConfig, build_engine, open_checkpoint
from engine.engine import EngineConfig
from engine.inputs.images import ImageProcessor, PreparedImage
from engine.inputs.tokenizer import Tokenizer
from engine.model import DiffusionLM
from engine.params import DecodingDefaults, ParamError, SamplingParams
from engine.types import StepOutput, TokenLogprob, tokens_per_forward

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One finished request. `output_ids` ends with the EOS token when one was generated."""

    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens)
    decoder_passes: int  # denoising steps, all canvases together (AR mode: 0)
    encoder_passes: int  # prefill chunks + commit passes (AR mode: + one per token)
    steps_per_canvas: list[int]
    seconds: float
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    verify_passes: int = 0  # hybrid: encoder passes over a draft (in encoder_passes too)
    accepted_tokens: int = 0  # hybrid: draft tokens the verifier accepted
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def tokens_per_forward(self) -> float:
        return tokens_per_forward(
            len(self.output_ids), self.decoder_passes, self.encoder_passes, self.verify_passes
        )


class LLM:
    def __init__(
        self,
        model: DiffusionLM,
        tokenizer: Tokenizer | None,
        defaults: DecodingDefaults,
        config: EngineConfig | None = None,
        image_processor: ImageProcessor | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.defaults = defaults
        checkpoint = Checkpoint(model, tokenizer, defaults, image_processor=image_processor)
        self.engine = build_engine(checkpoint, config)
        self.validator = self.engine.validator
        self.canvas_length = model.config.canvas_length
        self._next_id = 0

    @classmethod
    def from_config(cls, config: BuildConfig) -> LLM:
        """Open `config`'s checkpoint and build its engine (`engine.build`)."""
        c = open_checkpoint(config.checkpoint)
        return cls(c.model, c.tokenizer, c.defaults, config.engine, c.image_processor)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: str = "auto",
        device: str = "cpu",
        config: EngineConfig | None = None,
        exact: bool = False,
        kernels: str = "auto",
        adapter: str | Path | bool = True,
        generation_config: str | Path = "auto",
        override_generation_config: dict[str, Any] | None = None,
    ) -> LLM:
        """Load a checkpoint (`engine.build.CheckpointConfig` describes the arguments). `exact`:
        reference-exact numerics (token-identical to the transformers reference at batch size 1
        on CPU, batch invariant) instead of the fast batched default; `kernels`: a backend of
        `kernels.BACKENDS`; `adapter`: a decoder adapter directory, True for the checkpoint's
        own (if any), False for none; `generation_config`, `override_generation_config`: where
        the decoding defaults come from, and keys set over them."""
        checkpoint = CheckpointConfig(
            Path(model_dir),
            dtype,
            device,
            exact,
            kernels,
            adapter,
            generation_config,
            override_generation_config,
        )
        return cls.from_config(BuildConfig(checkpoint, config or EngineConfig()))

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "this checkpoint has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        images: Sequence[Sequence[PreparedImage]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs in prompt order. Parameters are
        checked and interpreted exactly as the server does (`engine.validation`): ParamError
        names the bad one before anything runs. `images`: each prompt's images
        (`engine.inputs.images`), whose image tokens the prompt's ids hold already
        (`expand_image_tokens`)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[assignment]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ParamError("params", f"{len(plist)} parameter sets for {len(prompts)} prompts")
        ids = [self.prompt_ids(p) for p in prompts]  # type: ignore[arg-type]
        resolved = [self.validator.validate(i, p) for i, p in zip(ids, plist, strict=True)]
        per_prompt = [tuple(i) for i in images] if images is not None else [()] * len(ids)
        if len(per_prompt) != len(ids):
            raise ParamError("images", f"{len(per_prompt)} image lists for {len(ids)} prompts")
        start = time.perf_counter()
        names = []
        for prompt, p, imgs in zip(ids, resolved, per_prompt, strict=True):
            name = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(name, prompt, p, images=imgs)
            names.append(name)
        tokens: dict[str, list[int]] = {n: [] for n in names}
        logprobs: dict[str, list[TokenLogprob]] = {n: [] for n in names}
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(names):
                for out in self.engine.step().outputs:
                    if out.error is not None:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    tokens[out.request_id] += out.new_token_ids
                    logprobs[out.request_id] += out.logprobs or []
                    if out.finish_reason is not None and out.stats is not None:
                        i = names.index(out.request_id)
                        lp = logprobs[out.request_id] if resolved[i].logprobs is not None else None
                        done[out.request_id] = self._output(
                            ids[i], tokens[out.request_id], out, start, lp
                        )
        finally:
            for name in names:
                if name not in done:
                    self.engine.abort(name)
        return [done[n] for n in names]

    def _output(
        self,
        prompt: list[int],
        tokens: list[int],
        out: StepOutput,
        start: float,
        logprobs: list[TokenLogprob] | None,
    ) -> RequestOutput:
        stats = out.stats
        assert stats is not None and out.finish_reason is not None, "a request's last output"
        return RequestOutput(
            prompt_ids=prompt,
            output_ids=tokens,
            text=self.tokenizer.decode(tokens) if self.tokenizer else "",
            finish_reason=str(out.finish_reason.value),
            decoder_passes=stats.decoder_passes,
            encoder_passes=stats.encoder_passes,
            steps_per_canvas=list(stats.steps_per_canvas),
            seconds=time.perf_counter() - start,
            logprobs=logprobs,
            verify_passes=stats.verify_passes,
            accepted_tokens=stats.accepted_tokens,
            num_cached_tokens=stats.num_cached_tokens,
        )
