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
from dataclasses import dataclass

import torch

from engine.logits.filters import top_p_floor
from engine.modes import policy
from engine.params import FLOAT_KNOBS, KNOB_NAMES, MAX_LOGIT_BIAS, ResolvedParams
from kernels import KernelSet
from kernels.reference import philox_uniform

# Counter layout (int64): canvas number | step | stream | position.
_POSITION_BITS = 19
_STREAM_BITS = 1
_STEP_BITS = 20
_CANVAS_SHIFT = _POSITION_BITS + _STREAM_BITS + _STEP_BITS
SAMPLE_STREAM, NOISE_STREAM = 0, 1
# AR tokens draw from their own counter space (the top counter bit below the sign); a hybrid
# verify pass's acceptance coins from theirs, one below (both at the token's output index).
_AR_COUNTERS = 1 << 62
_COIN_COUNTERS = _AR_COUNTERS | (1 << 61)


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
    """Per-slot denoising state and parameters of up to `num_slots` running requests: `knobs`
    holds one tensor per decoding knob (`engine.params.DecodingKnobs`), named after it (top_p's
    holds `top_p_floor(top_p)`; temperature's is 0 where the mode samples no tokens; logit_bias's
    holds the biases, their token ids are `bias_ids`)."""

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
        self.knobs = {
            name: zeros(num_slots, dtype=torch.float32 if name in FLOAT_KNOBS else torch.long)
            for name in KNOB_NAMES
        }
        # logit_bias: a request's (token id, bias) pairs, in order, zero-padded
        self.knobs["logit_bias"] = zeros(num_slots, MAX_LOGIT_BIAS, dtype=torch.float32)
        self.bias_ids = zeros(num_slots, MAX_LOGIT_BIAS)


@dataclass(slots=True)
class RowStates:
    """The denoising state of one step's DENOISE rows, gathered from their slots (a value: the
    slots are written only by `BatchedSampler.write`, after the step succeeded)."""

    slots: torch.Tensor  # [R]
    canvas_no: torch.Tensor  # [R]
    canvas: torch.Tensor  # [R, L]
    draft: torch.Tensor  # [R, L]
    soft: torch.Tensor  # [R, L, H]
    run: torch.Tensor  # [R]
    steps_left: torch.Tensor  # [R]
    num_steps: torch.Tensor  # [R]


ROW_FIELDS = ("canvas_no", "canvas", "draft", "soft", "run", "steps_left", "num_steps")


class BatchedSampler:
    """Vectorised sampling for fast numerics (see the module docstring). Slots are owned by the
    scheduler (one per running request); `bind` writes a newly admitted request's parameters
    into its slot, `canvas_inputs` and `denoise` compute without writing, and `write` stores a
    successful step's new state."""

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

    # -- slots --------------------------------------------------------------------------------

    def bind(self, slot: int, seed: int, params: ResolvedParams) -> None:
        """Write a newly running request's parameters into its slot (idempotent)."""
        s = self.state
        values = {name: getattr(params, name) for name in KNOB_NAMES}
        values["top_p"] = top_p_floor(params.top_p)  # what `filter_logits_` compares with
        # The mode decides whether the slot's temperature draws AR tokens.
        values["temperature"] = policy(params.mode).token_temperature(params)
        bias = values.pop("logit_bias")
        for name, value in values.items():
            s.knobs[name][slot] = value
        if bias:  # the rest of the row is never read (`engine.logits.batched`)
            ids, biases = zip(*bias, strict=True)
            s.bias_ids[slot, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            s.knobs["logit_bias"][slot, : len(ids)] = torch.tensor(biases, dtype=torch.float32)
        s.seed[slot] = seed
        s.canvas_no[slot] = -1

    def write(self, rows: RowStates, keep: torch.Tensor | None = None) -> None:
        """Store the new state of the rows (those flagged in `keep` [R] bool) in their slots."""
        s = self.state
        slots = rows.slots if keep is None else rows.slots[keep]
        for name in ROW_FIELDS:
            value = getattr(rows, name)
            getattr(s, name)[slots] = value if keep is None else value[keep]

    # -- inputs -------------------------------------------------------------------------------

    def canvas_inputs(
        self, slots: torch.Tensor, starting: torch.Tensor, pinned: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, RowStates]:
        """Canvas ids [R * L], self-conditioning input [R * L, H] and the row states of the
        DENOISE rows in `slots` [R]; rows flagged in `starting` [R] (bool) begin a new canvas:
        uniform random tokens, no self-conditioning signal, a fresh step count. `pinned` [R]:
        a token that slot 0 of the row's canvas holds at every step (hybrid), -1 for none."""
        s = self.state
        canvas_no = s.canvas_no[slots] + starting.long()  # [R]
        zero = torch.zeros_like(canvas_no)
        u = self.kernels.philox_uniform(
            s.seed[slots, None], counters(canvas_no, zero, NOISE_STREAM, self.canvas_length)
        )
        fresh = uniform_tokens(u, self.vocab_size)  # [R, L]
        start = starting[:, None]
        rows = RowStates(
            slots=slots,
            canvas_no=canvas_no,
            canvas=torch.where(start, fresh, s.canvas[slots]),
            draft=torch.where(start, -1, s.draft[slots]),
            soft=torch.where(start[:, :, None], 0.0, s.soft[slots]),  # [R, L, H]
            run=torch.where(starting, 0, s.run[slots]),
            steps_left=torch.where(
                starting, s.knobs["max_denoising_steps"][slots], s.steps_left[slots]
            ),
            num_steps=torch.where(starting, 0, s.num_steps[slots]),
        )
        if pinned is not None:
            rows.canvas[:, 0] = torch.where(pinned >= 0, pinned, rows.canvas[:, 0])
        return rows.canvas.view(-1), rows.soft.view(-1, rows.soft.shape[-1]), rows

    # -- the update ---------------------------------------------------------------------------

    def denoise(
        self, logits: torch.Tensor, rows: RowStates
    ) -> tuple[RowStates, list[torch.Tensor]]:
        """One denoising step of `rows` from their raw decoder logits [R * L, V] fp32. Returns
        the rows' new state (canvas, draft, stability run, steps, soft embeddings; not yet
        written) and device tensors for the host: finished [R], steps [R], drafts [R * L],
        failed [R] (non-finite logits: the row's request must fail alone)."""
        s, ks, knobs = self.state, self.kernels, self.state.knobs
        slots = rows.slots
        num_rows, length = slots.shape[0], self.canvas_length
        steps_left, num_steps = rows.steps_left, rows.num_steps
        t_min, max_steps = knobs["t_min"][slots], knobs["max_denoising_steps"][slots]
        temperature = t_min + (knobs["t_max"][slots] - t_min) * (steps_left / max_steps)
        per_position = temperature.repeat_interleave(length)  # [R * L]
        seeds, canvas_no = s.seed[slots, None], rows.canvas_no
        u = ks.philox_uniform(seeds, counters(canvas_no, num_steps, SAMPLE_STREAM, length))
        result, soft = ks.sample_and_embed(
            logits, per_position, u.view(-1), self.embedding, self.embed_scale
        )
        entropy = result.entropy.view(num_rows, length)
        accept = ks.entropy_accept(entropy, knobs["entropy_bound"][slots])  # [R, L] bool
        u_noise = ks.philox_uniform(seeds, counters(canvas_no, num_steps + 1, NOISE_STREAM, length))
        noise = uniform_tokens(u_noise, self.vocab_size)
        draft = result.argmax.view(num_rows, length)
        stable_run = torch.where((draft == rows.draft).all(-1), rows.run + 1, 0)
        steps_left, num_steps = steps_left - 1, num_steps + 1
        confident = entropy.mean(-1) < knobs["confidence_threshold"][slots]
        stable = stable_run >= knobs["stability_threshold"][slots]
        finished = (stable & confident) | (steps_left <= 0)
        new = RowStates(
            slots=slots,
            canvas_no=canvas_no,
            canvas=torch.where(accept, result.sample.view(num_rows, length), noise),
            draft=draft,
            soft=soft.view(num_rows, length, -1),
            run=stable_run,
            steps_left=steps_left,
            num_steps=num_steps,
        )
        failed = ~torch.isfinite(result.lse.view(num_rows, length)).all(-1)
        return new, [finished.long(), num_steps, draft.view(-1), failed.long()]

    def sample_ar(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        token_index: torch.Tensor,
        all_greedy: bool = False,
    ) -> list[torch.Tensor]:
        """Next tokens [R] of AR rows from their logits [R, V] fp32: greedy at temperature 0,
        else a draw at counter `token_index` [R] (the output position) of the request's stream;
        and failed [R] (non-finite logits). `all_greedy` (every row at temperature 0, known on
        the host): the argmax alone, without random numbers or a softmax."""
        if all_greedy:
            failed = ~torch.isfinite(torch.logsumexp(logits, dim=-1))
            return [logits.argmax(dim=-1), failed.long()]
        s = self.state
        temperature = s.knobs["temperature"][slots]
        greedy = temperature <= 0
        u = self.kernels.philox_uniform(s.seed[slots], token_index | _AR_COUNTERS)
        result = self.kernels.fused_sample(logits, torch.where(greedy, 1.0, temperature), u)
        tokens = torch.where(greedy, result.argmax, result.sample)
        return [tokens, (~torch.isfinite(result.lse)).long()]


class CounterDraws:
    """A hybrid verify pass's random numbers in fast numerics (`engine.verify.Draws`): the
    request's counter-based stream at the token's output index, so they never depend on the
    batch. Each index decides one token once, so no number is ever used twice."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = torch.tensor(seed, dtype=torch.long, device=device)

    def coins(self, first_index: int, num: int) -> list[float]:
        index = torch.arange(first_index, first_index + num, device=self.seed.device)
        return philox_uniform(self.seed, index | _COIN_COUNTERS).tolist()

    def categorical(self, weights: torch.Tensor, index: int) -> int:
        """Inverse CDF at the AR draw of this index (`sample_ar`'s counter)."""
        u = philox_uniform(self.seed, torch.tensor(index | _AR_COUNTERS, device=weights.device))
        cdf = weights.double().cumsum(0)
        found = torch.searchsorted(cdf, u.double() * cdf[-1], right=True)
        token = int(found.clamp(max=len(cdf) - 1))
        if weights[token] <= 0:  # rounding at the very top of the CDF
            token = int(weights.nonzero()[-1, 0])
        return token


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
