"""The engine's two samplers behind one Protocol, chosen once by the model's numerics.

- `BatchedSampling` (fast numerics): every canvas of a step in one vectorised update
  (`engine.batched_sampler`), counter-based random numbers, one host transfer per step.
- `ReferenceSampling` (exact numerics): the reference-compatible sampler (`engine.sampler`),
  one private `torch.Generator` per request drawing in the reference's order, so that a seed
  gives exactly the tokens of transformers' `generate()` at batch size 1 on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from engine.batched_sampler import BatchedSampler, CounterDraws, RowStates, to_host
from engine.device.cuda import to_device
from engine.device.graphs import ForwardGraphs
from engine.device.sampler_graphs import SamplerGraphs
from engine.device.step_buffers import SamplerInputs
from engine.logits.batched import process_rows_
from engine.logits.processors import process_, processes, processing
from engine.model import DiffusionLM
from engine.model.base import SoftEmbeds
from engine.request import RequestState
from engine.sampler import CanvasState, denoise_update, start_canvas
from engine.verify import Draws


@dataclass(frozen=True, slots=True)
class CanvasSample:
    """Host-side results of one denoising update, per row in the order given, and the rows'
    new sampler state (`staged`, for `Sampling.install`; nothing is written before that)."""

    finished: list[bool]  # the canvas converged or hit the step cap
    num_steps: list[int]  # steps taken by its canvas so far
    drafts: list[list[int] | None]  # the argmax canvas (when finished or asked for)
    failed: list[bool]  # non-finite logits
    staged: object = None


@dataclass(frozen=True, slots=True)
class TokenSample:
    """Host-side next tokens, per row in the order given (-1 where `failed`: non-finite
    logits), and the rows' new sampler state (`staged`, for `Sampling.install`)."""

    tokens: list[int]
    failed: list[bool]
    staged: object = None


@dataclass(frozen=True, slots=True)
class CanvasBatch:
    """The DENOISE rows' inputs: canvas ids [R * L], self-conditioning inputs, and their
    sampler state at this step (for `Sampling.sample_canvases`)."""

    ids: torch.Tensor
    soft: SoftEmbeds
    state: object


class Sampling(Protocol):
    """A step's sampling is pure: `bind`, `canvas_inputs` and the `sample_*` calls write
    nothing a re-run could see twice; only `install` stores the new state, once the step has
    succeeded. Slots are the scheduler's (`RequestState.slot`)."""

    def bind(self, reqs: list[RequestState]) -> None:
        """Set up the slots of newly running requests from their parameters (idempotent)."""

    def canvas_inputs(self, reqs: list[RequestState], starting: list[bool]) -> CanvasBatch:
        """The inputs of DENOISE rows; rows flagged in `starting` begin a new canvas. A hybrid
        request's canvas holds its pending token in slot 0 (`RequestState.pinned_token`)."""

    def sample_canvases(
        self, canvas: CanvasBatch, logits: torch.Tensor, reqs: list[RequestState]
    ) -> CanvasSample:
        """One denoising update of `reqs`' canvases (logits [R * L, V] fp32, which the
        requests' processors (`engine.logits`) overwrite in place, except the rows whose raw
        logits are read afterwards: `keeps_raw`)."""

    def sample_tokens(self, logits: torch.Tensor, reqs: list[RequestState]) -> TokenSample:
        """The next token of each of `reqs` (logits [R, V] fp32, processed in place as in
        `sample_canvases`)."""

    def install(self, sampled: CanvasSample | TokenSample, keep: list[bool]) -> None:
        """Store the new state of the rows whose step succeeded (`keep`)."""

    def verify_draws(self, reqs: list[RequestState]) -> list[Draws]:
        """The random numbers of hybrid verify passes (drawing from them writes nothing)."""

    def install_draws(self, reqs: list[RequestState], draws: list[Draws], keep: list[bool]) -> None:
        """Store what the verify passes that succeeded (`keep`) drew."""


def _slot(req: RequestState) -> int:
    assert req.slot is not None, "the request is not running"
    return req.slot


class BatchedSampling:
    def __init__(self, model: DiffusionLM, num_slots: int, graphs: ForwardGraphs | None) -> None:
        """`graphs`: the runner's, beside which the sampler's graphs replay (`sampler_graphs`)."""
        self.canvas_length = length = model.config.canvas_length
        weight, scale = model.embed_tokens.weight, float(model.embed_scale)
        self.sampler = BatchedSampler(model.kernels, weight, scale, length, num_slots)
        self.device = weight.device
        self.inputs = SamplerInputs(self.device, num_slots)  # slots and flags, per bucket
        graphed = SamplerGraphs(graphs, self.sampler, self.inputs) if graphs else None
        self.steps = graphed or self.sampler  # canvas inputs and update (replayed, or eager)
        self.sampled: RowStates | None = None  # the new state of the last canvases sampled

    def bind(self, reqs: list[RequestState]) -> None:
        for req in reqs:
            self.sampler.bind(_slot(req), req.seed, req.params)

    def _slots(self, reqs: list[RequestState]) -> torch.Tensor:
        return to_device(np.array([_slot(r) for r in reqs], dtype=np.int64), self.device)

    def canvas_inputs(self, reqs: list[RequestState], starting: list[bool]) -> CanvasBatch:
        slots, flags = self.inputs.stage([_slot(r) for r in reqs], starting)
        pinned = None
        tokens = [r.pinned_token for r in reqs]
        if any(token >= 0 for token in tokens):
            pinned = to_device(np.array(tokens, dtype=np.int64), self.device)
        ids, soft, rows = self.steps.canvas_inputs(slots, flags, pinned)
        return CanvasBatch(ids, soft, rows)

    def verify_draws(self, reqs: list[RequestState]) -> list[Draws]:
        return [CounterDraws(req.seed, self.device) for req in reqs]

    def install_draws(self, reqs: list[RequestState], draws: list[Draws], keep: list[bool]) -> None:
        pass  # counter-based: nothing to store

    def sample_canvases(
        self, canvas: CanvasBatch, logits: torch.Tensor, reqs: list[RequestState]
    ) -> CanvasSample:
        assert isinstance(canvas.state, RowStates)
        with self._processing(logits, canvas.state.slots, reqs, self.canvas_length):
            staged, parts = self.steps.denoise(logits, canvas.state)
        self.sampled = staged
        finished, steps, flat, failed = to_host(parts)
        length = self.canvas_length
        drafts: list[list[int] | None] = [
            flat[i * length : (i + 1) * length] for i in range(len(reqs))
        ]
        return CanvasSample(
            [bool(f) for f in finished], steps, drafts, [bool(f) for f in failed], staged
        )

    def sample_tokens(self, logits: torch.Tensor, reqs: list[RequestState]) -> TokenSample:
        slots = self._slots(reqs)
        index = to_device(np.array([len(r.output_ids) for r in reqs], dtype=np.int64), self.device)
        # The slots' temperatures as `BatchedSampler.bind` sets them, read on the host.
        greedy = all(r.policy.token_temperature(r.params) <= 0 for r in reqs)
        with self._processing(logits, slots, reqs, 1):
            drawn = self.sampler.sample_ar(logits, slots, index, all_greedy=greedy)
        tokens, failed = to_host(drawn)
        return TokenSample(tokens, [bool(f) for f in failed])  # stateless: counter = position

    @contextmanager
    def _processing(
        self, logits: torch.Tensor, slots: torch.Tensor, reqs: list[RequestState], length: int
    ) -> Iterator[None]:
        """The rows' logits processors applied in place inside (`engine.logits`)."""
        with processing(logits, length, reqs) as rows:
            if rows:
                state = self.sampler.state
                process_rows_(logits, length, reqs, slots, state.knobs, state.bias_ids)
            yield

    def install(self, sampled: CanvasSample | TokenSample, keep: list[bool]) -> None:
        if not isinstance(sampled.staged, RowStates) or not any(keep):
            return  # token draws are stateless (counter = output position)
        mask = None
        if not all(keep):
            mask = to_device(np.array(keep, dtype=np.bool_), self.device)
        self.steps.write(sampled.staged, mask)


@dataclass(slots=True)
class _ReferenceState:
    """A request's private generator and its current canvas (exact numerics)."""

    generator: torch.Generator
    canvas: CanvasState | None = None

    def fork(self) -> _ReferenceState:
        """A copy to draw from: the generator's state and the canvas's history are copied,
        so drawing from the fork leaves this state as it was."""
        generator = torch.Generator(device=self.generator.device)
        generator.set_state(self.generator.get_state())
        canvas = self.canvas
        if canvas is not None:
            canvas = replace(canvas, generator=generator, history=list(canvas.history))
        return _ReferenceState(generator, canvas)


@dataclass(frozen=True, slots=True)
class _Staged:
    """The forks a step's rows drew from, for `install`."""

    reqs: list[RequestState]
    forks: list[_ReferenceState]


class ReferenceSampling:
    def __init__(self, model: DiffusionLM, num_slots: int) -> None:
        self.model = model
        self.canvas_length = model.config.canvas_length
        self.device = model.embed_tokens.weight.device
        self.states: list[_ReferenceState | None] = [None] * num_slots

    def bind(self, reqs: list[RequestState]) -> None:
        for req in reqs:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.seed)
            self.states[_slot(req)] = _ReferenceState(gen)

    def _fork(self, req: RequestState) -> _ReferenceState:
        state = self.states[_slot(req)]
        assert state is not None, "bind() the request first"
        return state.fork()

    def canvas_inputs(self, reqs: list[RequestState], starting: list[bool]) -> CanvasBatch:
        forks = [self._fork(req) for req in reqs]
        for req, state, new in zip(reqs, forks, starting, strict=True):
            if new:
                state.canvas = start_canvas(
                    req.params,
                    self.model.cfg.vocab_size,
                    self.canvas_length,
                    state.generator,
                    self.device,
                )
        for req, state in zip(reqs, forks, strict=True):
            if req.pinned_token >= 0 and state.canvas is not None:  # a new tensor: the fork's
                state.canvas.canvas = state.canvas.canvas.clone()
                state.canvas.canvas[0] = req.pinned_token
        canvases = [s.canvas for s in forks]
        assert all(c is not None for c in canvases), "a canvas continues that never started"
        ids = torch.cat([c.canvas for c in canvases if c is not None])
        return CanvasBatch(ids, [c.soft_embeds for c in canvases if c is not None], forks)

    def sample_canvases(
        self, canvas: CanvasBatch, logits: torch.Tensor, reqs: list[RequestState]
    ) -> CanvasSample:
        forks: list[_ReferenceState] = list(canvas.state)  # type: ignore[call-overload]
        rows = logits.view(len(reqs), self.canvas_length, -1)
        finished, steps, drafts, failed = self._denoise(rows, reqs, forks)
        return CanvasSample(finished, steps, drafts, failed, _Staged(reqs, forks))

    def sample_tokens(self, logits: torch.Tensor, reqs: list[RequestState]) -> TokenSample:
        forks = [self._fork(req) for req in reqs]
        failed: list[bool] = (~_finite_rows(logits)).tolist()
        with processing(logits, 1, reqs):
            tokens = [
                -1 if bad else self._ar_token(req, logits[k : k + 1], fork.generator)
                for k, (req, fork, bad) in enumerate(zip(reqs, forks, failed, strict=True))
            ]
        return TokenSample(tokens, failed, _Staged(reqs, forks))

    def _denoise(
        self, logits: torch.Tensor, denoise: list[RequestState], forks: list[_ReferenceState]
    ) -> tuple[list[bool], list[int], list[list[int] | None], list[bool]]:
        """One update of the forks' canvases from logits [R, L, V]; a row whose logits are
        not finite is left out and flagged (it fails alone)."""
        num_rows = len(denoise)
        finished, steps = [False] * num_rows, [0] * num_rows
        drafts: list[list[int] | None] = [None] * num_rows
        per_position = _finite_rows(logits.reshape(-1, logits.shape[-1])).view(num_rows, -1)
        failed: list[bool] = (~per_position.all(-1)).tolist()
        good = [j for j, bad in enumerate(failed) if not bad]
        if not good:
            return finished, steps, drafts, failed
        states = [forks[j].canvas for j in good]
        with processing(logits, self.canvas_length, denoise) as processed:
            rows = logits if len(good) == num_rows else logits[good]
            for i, j in enumerate(good):
                if j in processed:
                    process_(rows[i], denoise[j])  # in place
            scaled, probs = denoise_update(rows, states, [denoise[j].params for j in good])  # type: ignore[arg-type]
        soft = self.model.soft_embed(scaled, probs)
        for i, j in enumerate(good):
            state = states[i]
            assert state is not None and state.argmax is not None
            state.soft_embeds = soft[i]
            finished[j], steps[j] = state.finished, state.num_steps
            if state.finished or denoise[j].want_drafts:
                drafts[j] = state.argmax.tolist()
            if state.finished:
                forks[j].canvas = None
        return finished, steps, drafts, failed

    def install(self, sampled: CanvasSample | TokenSample, keep: list[bool]) -> None:
        staged = sampled.staged
        assert isinstance(staged, _Staged)
        for req, state, ok in zip(staged.reqs, staged.forks, keep, strict=True):
            if ok:
                self.states[_slot(req)] = state

    def verify_draws(self, reqs: list[RequestState]) -> list[Draws]:
        return [GeneratorDraws(self._fork(req)) for req in reqs]

    def install_draws(self, reqs: list[RequestState], draws: list[Draws], keep: list[bool]) -> None:
        for req, drawn, ok in zip(reqs, draws, keep, strict=True):
            if ok:
                assert isinstance(drawn, GeneratorDraws)
                self.states[_slot(req)] = drawn.state

    @staticmethod
    def _ar_token(req: RequestState, logits: torch.Tensor, generator: torch.Generator) -> int:
        """The next token from its logits [1, V] (processed in place first)."""
        if processes(req.params):
            process_(logits, req)
        logits = logits[0]
        temperature = req.params.temperature
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            return int(torch.multinomial(probs, 1, generator=generator))
        return int(logits.argmax())


class GeneratorDraws:
    """A hybrid verify pass's random numbers in exact numerics (`engine.verify.Draws`): a fork
    of the request's generator, drawn in order (the index is not needed)."""

    def __init__(self, state: _ReferenceState) -> None:
        self.state = state

    def coins(self, first_index: int, num: int) -> list[float]:
        generator = self.state.generator
        return torch.rand(num, generator=generator, device=generator.device).tolist()

    def categorical(self, weights: torch.Tensor, index: int) -> int:
        return int(torch.multinomial(weights, 1, generator=self.state.generator))


def _finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per row of [R, N] logits: whether they make a distribution (no NaN or +inf, not all
    -inf; a grammar's -inf mask is fine) — the fast sampler's test (a finite log-normaliser)."""
    return torch.isfinite(torch.logsumexp(logits, dim=-1)) & ~torch.isnan(logits).any(-1)


def make_sampling(model: DiffusionLM, num_slots: int, graphs: ForwardGraphs | None) -> Sampling:
    """The sampler of the model's bound numerics (`graphs`: `BatchedSampling`'s)."""
    if model.kernels.exact:
        return ReferenceSampling(model, num_slots)
    return BatchedSampling(model, num_slots, graphs)
