"""Helpers of the logits-processor tests: the filters as a function returning a copy, a
request state around resolved parameters, and a reference processor applied per position."""

from __future__ import annotations

import torch

from engine.logits.filters import filter_logits_
from engine.params import DecodingDefaults, ResolvedParams, SamplingParams
from engine.request import RequestState


def filter_logits(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    floor: torch.Tensor,
    max_k: int,
    any_p: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """`filter_logits_` on a copy (min_p None: off)."""
    out = logits.clone()
    any_min_p = min_p is not None
    if min_p is None:
        min_p = torch.zeros(logits.shape[0])
    filter_logits_(out, top_k, floor, min_p, max_k, any_p, any_min_p)
    return out


def request(
    params: ResolvedParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    canvas_length: int = 16,
    **overrides: object,
) -> RequestState:
    """A request state with these parameters (or SamplingParams `overrides` resolved) and
    these prompt and committed tokens."""
    if params is None:
        params = DecodingDefaults().resolve(SamplingParams(**overrides))  # type: ignore[arg-type]
    req = RequestState("r", list(prompt or [1]), params, 64, canvas_length)
    req.output_ids = list(output or [])
    return req


class PerPosition:
    """A reference processor applied to [positions, V] with each position's `input_ids`: the
    reference's diffusion logits are [B, L, V], and its warpers are written for [B, V]
    (`TopPLogitsWarper` scatters along dim 1, `RepetitionPenaltyLogitsProcessor` penalises
    only the last position of 3-d scores)."""

    def __init__(self, processor: object) -> None:
        self.processor = processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        flat = scores.reshape(-1, scores.shape[-1])
        ids = input_ids.repeat_interleave(flat.shape[0] // input_ids.shape[0], dim=0)
        return self.processor(ids, flat).view_as(scores)  # type: ignore[operator]
