"""Engine-side state of one request (the scheduler keeps its own `Sequence`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.params import ResolvedParams
from engine.sampler import CanvasState


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    want_drafts: bool
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    draft_to_commit: list[int] | None = None
    steps_per_canvas: list[int] = field(default_factory=list)
    decoder_passes: int = 0
    encoder_passes: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    canvas_started: float = 0.0
    in_canvas: bool = False  # a canvas is being denoised
    # Sampler state: a slot of the batched sampler (fast numerics), or a private generator and
    # canvas state (exact numerics).
    slot: int | None = None
    generator: torch.Generator | None = None
    canvas: CanvasState | None = None
