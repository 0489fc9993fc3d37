"""The fast diffusion sampler: one vectorised update for every canvas of a step.

Same algorithm as `engine.sampler` (the reference's: linear temperature schedule, a sample at
every position, entropy-bound acceptance, uniform re-noising, stable-and-confident stop), batched:
per-request state lives in persistent per-slot tensors (one slot per running request), a step
gathers its rows by slot index, runs the bound kernels (`sample_and_embed`: the fused sampler
and the soft embedding; `entropy_accept`) over all positions at once, writes the state back,
and moves its results to the host once.

Random numbers come from a counter-based stream: Philox keyed by the request's seed, at a
counter made of (canvas number, step, stream, position) — so a request's draws never depend on
what else is in the batch, and a seed gives the same output alone or in any batch.
"""

from __future__ import annotations

import os

import torch

from engine.params import DecodeMode, ResolvedParams
from kernels import KernelSet
from kernels.reference import philox_uniform

# Counter layout (int64): canvas number | step | stream | position.
_POSITION_BITS = 19
_STREAM_BITS = 1
_STEP_BITS = 20
_CANVAS_SHIFT = _POSITION_BITS + _STREAM_BITS + _STEP_BITS
SAMPLE_STREAM, NOISE_STREAM = 0, 1
# AR tokens draw from their own counter space (the top counter bit below the sign).
_AR_COUNTERS = 1 << 62


def counters(canvas_no: torch.Tensor, step: torch.Tensor, stream: int, length: int) -> torch.Tensor:
    """Philox counters [R, length] of the positions of R canvases at a step and stream."""
    base = (canvas_no << _CANVAS_SHIFT) | (step << (_POSITION_BITS + _STREAM_BITS))
    base = base | (stream << _POSITION_BITS)
    return base[:, None] + torch.arange(length, device=canvas_no.device)


def uniform_tokens(u: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform token ids from uniform numbers in [0, 1)."""
    return (u * vocab_size).long().clamp_(max=vocab_size - 1)


def new_seed() -> int:
    """A seed for a request that gave none."""
    return int.from_bytes(os.urandom(8), "little") >> 1


class SlotState:
    """Per-slot denoising state and parameters of up to `num_slots` running requests."""

    def __init__(
        self,
        num_slots: int,
        canvas_length: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.canvas = zeros(num_slots, canvas_length)  # current (noisy) canvas
        self.draft = zeros(num_slots, canvas_length)  # the last argmax canvas (-1: none yet)
        self.soft = zeros(num_slots, canvas_length, hidden, dtype=dtype)  # self-conditioning
        self.run = zeros(num_slots)  # consecutive steps with an unchanged draft
        self.steps_left = zeros(num_slots)
        self.num_steps = zeros(num_slots)
        self.canvas_no = zeros(num_slots)
        self.seed = zeros(num_slots)
        self.max_steps = zeros(num_slots)
        self.stability = zeros(num_slots)
        self.t_min = zeros(num_slots, dtype=torch.float32)
        self.t_max = zeros(num_slots, dtype=torch.float32)
        self.bound = zeros(num_slots, dtype=torch.float32)
        self.confidence = zeros(num_slots, dtype=torch.float32)
        self.temperature = zeros(num_slots, dtype=torch.float32)  # AR


class BatchedSampler:
    """Vectorised sampling for fast numerics (see the module docstring). Slots are handed out
    by the engine (`assign`) and freed with the request (`release`)."""

    def __init__(
        self,
        kernels: KernelSet,
        embedding: torch.Tensor,
        embed_scale: float,
        canvas_length: int,
        num_slots: int,
    ) -> None:
        self.kernels = kernels
        self.embedding = embedding  # [V, H]
        self.embed_scale = embed_scale
        self.vocab_size, hidden = embedding.shape
        self.canvas_length = canvas_length
        self.device = embedding.device
        self.state = SlotState(num_slots, canvas_length, hidden, embedding.dtype, self.device)
        self.free = list(range(num_slots - 1, -1, -1))

    # -- slots --------------------------------------------------------------------------------

    def assign(self, params: ResolvedParams) -> int:
        """A slot for a newly running request, with its parameters written once."""
        slot = self.free.pop()
        s = self.state
        values = {
            s.seed: params.seed if params.seed is not None else new_seed(),
            s.max_steps: params.max_denoising_steps,
            s.stability: params.stability_threshold,
            s.t_min: params.t_min,
            s.t_max: params.t_max,
            s.bound: params.entropy_bound,
            s.confidence: params.confidence_threshold,
            s.temperature: params.temperature if params.mode is DecodeMode.AR else 0.0,
            s.canvas_no: -1,
        }
        for tensor, value in values.items():
            tensor[slot] = value
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    # -- inputs -------------------------------------------------------------------------------

    def canvas_inputs(
        self, slots: torch.Tensor, starting: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Canvas ids [R * L] and self-conditioning input [R * L, H] of the DENOISE rows in
        `slots` [R]; rows flagged in `starting` [R] (bool) begin a new canvas: uniform random
        tokens, no self-conditioning signal, a fresh step count."""
        s = self.state
        canvas_no = s.canvas_no[slots] + starting.long()  # [R]
        zero = torch.zeros_like(canvas_no)
        u = philox_uniform(
            s.seed[slots, None], counters(canvas_no, zero, NOISE_STREAM, self.canvas_length)
        )
        fresh = uniform_tokens(u, self.vocab_size)  # [R, L]
        start = starting[:, None]
        canvas = torch.where(start, fresh, s.canvas[slots])
        soft = torch.where(start[:, :, None], 0.0, s.soft[slots])  # [R, L, H]
        s.canvas_no[slots] = canvas_no
        s.canvas[slots] = canvas
        s.steps_left[slots] = torch.where(starting, s.max_steps[slots], s.steps_left[slots])
        s.num_steps[slots] = torch.where(starting, 0, s.num_steps[slots])
        s.run[slots] = torch.where(starting, 0, s.run[slots])
        s.draft[slots] = torch.where(start, -1, s.draft[slots])
        return canvas.view(-1), soft.view(-1, soft.shape[-1])

    # -- the update ---------------------------------------------------------------------------

    def denoise(self, logits: torch.Tensor, slots: torch.Tensor) -> list[torch.Tensor]:
        """One denoising step of the canvases in `slots` [R] from their raw decoder logits
        [R * L, V] fp32. Updates the slots' state (canvas, draft, stability run, steps, soft
        embeddings) and returns device tensors for the host: finished [R], steps [R],
        drafts [R * L], failed [R] (non-finite logits: the row's request must fail alone)."""
        s, ks = self.state, self.kernels
        num_rows, length = slots.shape[0], self.canvas_length
        steps_left, num_steps = s.steps_left[slots], s.num_steps[slots]
        t_min = s.t_min[slots]
        temperature = t_min + (s.t_max[slots] - t_min) * (steps_left / s.max_steps[slots])
        per_position = temperature.repeat_interleave(length)  # [R * L]
        seeds, canvas_no = s.seed[slots, None], s.canvas_no[slots]
        u = philox_uniform(seeds, counters(canvas_no, num_steps, SAMPLE_STREAM, length))
        result, soft = ks.sample_and_embed(
            logits, per_position, u.view(-1), self.embedding, self.embed_scale
        )
        entropy = result.entropy.view(num_rows, length)
        accept = ks.entropy_accept(entropy, s.bound[slots])  # [R, L] bool
        u_noise = philox_uniform(seeds, counters(canvas_no, num_steps + 1, NOISE_STREAM, length))
        noise = uniform_tokens(u_noise, self.vocab_size)
        draft = result.argmax.view(num_rows, length)
        stable_run = torch.where((draft == s.draft[slots]).all(-1), s.run[slots] + 1, 0)
        steps_left, num_steps = steps_left - 1, num_steps + 1
        confident = entropy.mean(-1) < s.confidence[slots]
        finished = ((stable_run >= s.stability[slots]) & confident) | (steps_left <= 0)
        s.canvas[slots] = torch.where(accept, result.sample.view(num_rows, length), noise)
        s.draft[slots] = draft
        s.run[slots] = stable_run
        s.steps_left[slots] = steps_left
        s.num_steps[slots] = num_steps
        s.soft[slots] = soft.view(num_rows, length, -1)
        failed = ~torch.isfinite(result.lse.view(num_rows, length)).all(-1)
        return [finished.long(), num_steps, draft.view(-1), failed.long()]

    def sample_ar(
        self, logits: torch.Tensor, slots: torch.Tensor, token_index: torch.Tensor
    ) -> list[torch.Tensor]:
        """Next tokens [R] of AR rows from their logits [R, V] fp32: greedy at temperature 0,
        else a draw at counter `token_index` [R] (the output position) of the request's stream;
        and failed [R] (non-finite logits)."""
        s = self.state
        temperature = s.temperature[slots]
        greedy = temperature <= 0
        u = philox_uniform(s.seed[slots], token_index | _AR_COUNTERS)
        result = self.kernels.fused_sample(logits, torch.where(greedy, 1.0, temperature), u)
        tokens = torch.where(greedy, result.argmax, result.sample)
        return [tokens, (~torch.isfinite(result.lse)).long()]


def to_host(parts: list[torch.Tensor]) -> list[list[int]]:
    """The step's one device-to-host transfer: int64 tensors concatenated, moved, split."""
    if not parts:
        return []
    sizes = [p.numel() for p in parts]
    flat = torch.cat([p.reshape(-1) for p in parts]).tolist()
    out, start = [], 0
    for n in sizes:
        out.append(flat[start : start + n])
        start += n
    return out
