"""The diffusion sampler: one denoising update over a batch of canvases.

Per row and step (N = max_denoising_steps, n = steps remaining, N..1):
  T = t_min + (t_max - t_min) * n / N;  scaled = logits / T;  probs = softmax(scaled)
  sample a token at every position; sort positions by entropy; accept the lowest-entropy ones
  while (cumulative entropy - own entropy) <= entropy_bound; accepted positions take the sample,
  all others are re-drawn uniformly; argmax canvas = argmax(scaled).
  Stop when the argmax canvas equals each of the last `stability_threshold` ones and the mean
  entropy is below `confidence_threshold`, or after step 1.

This is the reference-compatible sampler: each row draws from its own `torch.Generator` in the
reference's order (canvas init; then per step: multinomial over the canvas, uniform re-noise)
and every value is computed with the reference's operations, so that at batch size 1 on CPU a
seed gives exactly the tokens of `DiffusionGemmaForBlockDiffusion.generate` after
`torch.manual_seed(seed)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.params import ResolvedParams


def new_canvas(
    vocab_size: int, canvas_length: int, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """A canvas of uniformly random tokens [canvas_length] (the reference draws shape (1, L))."""
    return torch.randint(0, vocab_size, (1, canvas_length), generator=generator, device=device)[0]


def temperature(params: ResolvedParams, steps_left: int) -> torch.Tensor:
    """The linear schedule, computed in fp32 tensor arithmetic exactly as the reference does."""
    step = torch.tensor(steps_left, dtype=torch.int32)
    return params.t_min + (params.t_max - params.t_min) * (step / params.max_denoising_steps)


def token_entropy(scaled: torch.Tensor) -> torch.Tensor:
    """Entropy [..., L] of softmax(scaled) over the last dim (torch.distributions.Categorical's)."""
    log_probs = scaled - scaled.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(log_probs, dim=-1)
    return -(torch.clamp(log_probs, min=torch.finfo(log_probs.dtype).min) * probs).sum(-1)


@dataclass(slots=True)
class CanvasState:
    """The denoising state of one request's current canvas."""

    canvas: torch.Tensor  # [L] current (noisy) canvas
    generator: torch.Generator
    steps_left: int  # n in N..1; the next step uses this value
    argmax: torch.Tensor | None = None  # [L] the latest draft
    history: list[torch.Tensor] = field(default_factory=list)  # previous drafts, oldest first
    soft_embeds: torch.Tensor | None = None  # [L, H] self-conditioning input of the next step
    num_steps: int = 0
    finished: bool = False


def start_canvas(
    params: ResolvedParams,
    vocab_size: int,
    canvas_length: int,
    generator: torch.Generator,
    device: torch.device,
) -> CanvasState:
    canvas = new_canvas(vocab_size, canvas_length, generator, device)
    history = [
        torch.full((canvas_length,), -1, dtype=torch.long, device=device)
    ] * params.stability_threshold
    return CanvasState(
        canvas=canvas, generator=generator, steps_left=params.max_denoising_steps, history=history
    )


def denoise_update(
    logits: torch.Tensor, states: list[CanvasState], params: list[ResolvedParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply one denoising step to every row. logits: [R, L, V] fp32 raw decoder logits.

    Updates each state in place (canvas, draft, history, step counter, finished) and returns
    the temperature-scaled logits and their softmax ([R, L, V] fp32), from which the next
    step's self-conditioning signal is computed.
    """
    num_rows, canvas_length, vocab_size = logits.shape
    temps = torch.stack([temperature(p, s.steps_left) for p, s in zip(params, states, strict=True)])
    scaled = logits / temps.to(logits.device)[:, None, None]  # [R, L, V]
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    samples = torch.stack(
        [torch.multinomial(probs[r], 1, generator=s.generator)[:, 0] for r, s in enumerate(states)]
    )  # [R, L]
    argmax = scaled.argmax(dim=-1)  # [R, L]
    entropy = token_entropy(scaled)  # [R, L]
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    cumulative = torch.cumsum(sorted_entropy, dim=-1)
    for r, (state, p) in enumerate(zip(states, params, strict=True)):
        sorted_accept = cumulative[r] - sorted_entropy[r] <= p.entropy_bound
        accept = torch.scatter(torch.zeros_like(sorted_accept), -1, order[r], sorted_accept)
        accepted = torch.where(accept, samples[r], state.canvas)
        noise = new_canvas(vocab_size, canvas_length, state.generator, logits.device)
        state.canvas = torch.where(~accept, noise, accepted)
        state.finished = _should_stop(state, argmax[r], entropy[r], p)
        state.argmax = argmax[r]
        state.steps_left -= 1
        state.num_steps += 1
        state.finished |= state.steps_left == 0
    return scaled, probs


def _should_stop(
    state: CanvasState, argmax: torch.Tensor, entropy: torch.Tensor, p: ResolvedParams
) -> bool:
    """Stable (draft equal to the last `stability_threshold` drafts) and confident."""
    stable = all(bool((prev == argmax).all()) for prev in state.history)
    if state.history:
        state.history = [*state.history[1:], argmax]
    confident = bool(torch.mean(entropy, dim=-1) < p.confidence_threshold)
    return stable and confident
