"""The engine's two samplers behind one Protocol, chosen once by the model's numerics.

- `BatchedSampling` (fast numerics): every canvas of a step in one vectorised update
  (`engine.batched_sampler`), counter-based random numbers, one host transfer per step.
- `ReferenceSampling` (exact numerics): the reference-compatible sampler (`engine.sampler`),
  one private `torch.Generator` per request drawing in the reference's order, so that a seed
  gives exactly the tokens of transformers' `generate()` at batch size 1 on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.batched_sampler import BatchedSampler, to_host
from engine.model import DiffusionLM
from engine.model.base import SoftEmbeds
from engine.request import RequestState
from engine.sampler import CanvasState, denoise_update, start_canvas


@dataclass(slots=True)
class Sampled:
    """Host-side results of one step's sampling, in the order of the rows given."""

    finished: list[bool]  # per DENOISE row: the canvas converged or hit the step cap
    num_steps: list[int]  # per DENOISE row: steps taken by its canvas so far
    drafts: list[list[int] | None]  # per DENOISE row: the argmax canvas (when finished or asked)
    ar_tokens: list[int]  # per AR-sampled row: the next token
    failed: list[bool] = field(default_factory=list)  # per DENOISE row: non-finite logits
    ar_failed: list[bool] = field(default_factory=list)  # per AR-sampled row

    def __post_init__(self) -> None:
        self.failed = self.failed or [False] * len(self.finished)
        self.ar_failed = self.ar_failed or [False] * len(self.ar_tokens)


class Sampling(Protocol):
    def admit(self, req: RequestState) -> None:
        """The request starts running: set up its sampler state."""

    def release(self, req: RequestState) -> None:
        """The request finished or was aborted: free its sampler state."""

    def canvas_inputs(self, reqs: list[RequestState]) -> tuple[torch.Tensor, SoftEmbeds]:
        """Canvas ids [R * L] and self-conditioning inputs of DENOISE rows; a request that is
        not in a canvas starts one."""

    def sample(
        self,
        denoise_logits: torch.Tensor | None,
        denoise: list[RequestState],
        ar_logits: torch.Tensor | None,
        ar: list[RequestState],
    ) -> Sampled:
        """One denoising update of `denoise` (logits [R * L, V] fp32) and the next token of
        `ar` (logits [R_ar, V] fp32)."""


class BatchedSampling:
    def __init__(self, model: DiffusionLM, num_slots: int) -> None:
        self.canvas_length = model.config.canvas_length
        self.sampler = BatchedSampler(
            model.kernels,
            model.embed_tokens.weight,
            float(model.embed_scale),
            self.canvas_length,
            num_slots,
        )
        self.device = model.embed_tokens.weight.device

    def admit(self, req: RequestState) -> None:
        req.sampler_state = self.sampler.assign(req.params)  # the request's slot

    def release(self, req: RequestState) -> None:
        if isinstance(req.sampler_state, int):
            self.sampler.release(req.sampler_state)
            req.sampler_state = None

    def _slots(self, reqs: list[RequestState]) -> torch.Tensor:
        return torch.tensor([r.sampler_state for r in reqs], dtype=torch.long).to(self.device)

    def canvas_inputs(self, reqs: list[RequestState]) -> tuple[torch.Tensor, SoftEmbeds]:
        starting = torch.tensor([not r.in_canvas for r in reqs]).to(self.device)
        for r in reqs:
            r.in_canvas = True
        return self.sampler.canvas_inputs(self._slots(reqs), starting)

    def sample(
        self,
        denoise_logits: torch.Tensor | None,
        denoise: list[RequestState],
        ar_logits: torch.Tensor | None,
        ar: list[RequestState],
    ) -> Sampled:
        parts: list[torch.Tensor] = []
        if denoise:
            assert denoise_logits is not None
            parts += self.sampler.denoise(denoise_logits, self._slots(denoise))
        if ar:
            assert ar_logits is not None
            index = torch.tensor([len(r.output_ids) for r in ar]).to(self.device)
            parts += self.sampler.sample_ar(ar_logits, self._slots(ar), index)
        host = to_host(parts)
        ar_tokens, ar_failed = (host[-2], host[-1]) if ar else ([], [])
        if not denoise:
            return Sampled([], [], [], ar_tokens, [], [bool(f) for f in ar_failed])
        finished, steps, flat, failed = host[0], host[1], host[2], host[3]
        length = self.canvas_length
        drafts: list[list[int] | None] = [
            flat[i * length : (i + 1) * length] for i in range(len(denoise))
        ]
        return Sampled(
            [bool(f) for f in finished],
            steps,
            drafts,
            ar_tokens,
            [bool(f) for f in failed],
            [bool(f) for f in ar_failed],
        )


@dataclass(slots=True)
class _ReferenceState:
    """A request's private generator and its current canvas (exact numerics)."""

    generator: torch.Generator
    canvas: CanvasState | None = None


def _reference(req: RequestState) -> _ReferenceState:
    assert isinstance(req.sampler_state, _ReferenceState), "admit() the request first"
    return req.sampler_state


class ReferenceSampling:
    def __init__(self, model: DiffusionLM) -> None:
        self.model = model
        self.canvas_length = model.config.canvas_length
        self.device = model.embed_tokens.weight.device

    def admit(self, req: RequestState) -> None:
        gen = torch.Generator(device=self.device)
        if req.params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(req.params.seed)
        req.sampler_state = _ReferenceState(gen)

    def release(self, req: RequestState) -> None:
        req.sampler_state = None

    def canvas_inputs(self, reqs: list[RequestState]) -> tuple[torch.Tensor, SoftEmbeds]:
        for req in reqs:
            state = _reference(req)
            if state.canvas is None:
                req.in_canvas = True
                state.canvas = start_canvas(
                    req.params,
                    self.model.cfg.vocab_size,
                    self.canvas_length,
                    state.generator,
                    self.device,
                )
        states = [_reference(r).canvas for r in reqs]
        ids = torch.cat([s.canvas for s in states if s is not None])
        return ids, [s.soft_embeds for s in states if s is not None]

    def sample(
        self,
        denoise_logits: torch.Tensor | None,
        denoise: list[RequestState],
        ar_logits: torch.Tensor | None,
        ar: list[RequestState],
    ) -> Sampled:
        finished, steps, drafts = [], [], []
        if denoise:
            assert denoise_logits is not None
            states = [_reference(r).canvas for r in denoise]
            logits = denoise_logits.view(len(denoise), self.canvas_length, -1)
            scaled, probs = denoise_update(logits, states, [r.params for r in denoise])  # type: ignore[arg-type]
            soft = self.model.soft_embed(scaled, probs)
            for j, (req, state) in enumerate(zip(denoise, states, strict=True)):
                assert state is not None and state.argmax is not None
                state.soft_embeds = soft[j]
                finished.append(state.finished)
                steps.append(state.num_steps)
                drafts.append(state.argmax.tolist() if state.finished or req.want_drafts else None)
                if state.finished:
                    _reference(req).canvas = None
        tokens = [self._ar_token(req, ar_logits[k]) for k, req in enumerate(ar)] if ar else []  # type: ignore[index]
        return Sampled(finished, steps, drafts, tokens)

    @staticmethod
    def _ar_token(req: RequestState, logits: torch.Tensor) -> int:
        temperature = req.params.temperature
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            return int(torch.multinomial(probs, 1, generator=_reference(req).generator))
        return int(logits.argmax())


def make_sampling(model: DiffusionLM, num_slots: int) -> Sampling:
    """The sampler of the model's bound numerics."""
    if model.kernels.exact:
        return ReferenceSampling(model)
    return BatchedSampling(model, num_slots)
