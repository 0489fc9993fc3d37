"""The transformers reference, served the way someone without Canvas would serve it.

`DiffusionGemmaForBlockDiffusion.generate()` either one request at a time, or in static
batches: requests grouped in arrival order, left-padded to the longest prompt, with an
attention mask. The reference masks padded keys in both the encoder and the canvas decoder; a
padded row's positions are shifted by its padding, which rotary attention does not see (only
relative positions matter), so a padded row decodes like the same prompt alone.

Budgets match Canvas runs with `ignore_eos` and `confidence_threshold=0`: EOS is switched off
(`eos_token_id=None`, so every request gets its whole budget), and the adaptive stop is made
unreachable with a tiny positive threshold (the reference requires > 0). Every decoder pass
is counted, so the records show whether each canvas really ran the fixed number of steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.stats import RequestRecord, gaps

logger = logging.getLogger(__name__)
UNREACHABLE_CONFIDENCE = 1e-30  # the stop needs mean entropy below it: never, before the cap


@dataclass(frozen=True, slots=True)
class ReferenceSettings:
    max_new_tokens: int  # requests keep this many tokens; the reference computes whole canvases
    max_denoising_steps: int
    seed: int = 0  # request i runs after torch.manual_seed(seed + i), as Canvas' `seed` does
    confidence_threshold: float = UNREACHABLE_CONFIDENCE


@dataclass(slots=True)
class _Clock:
    """Streamer and decoder hook in one: times each committed canvas and counts decoder
    passes. generate() first puts the prompt, then each committed canvas."""

    passes: int = 0
    prompt_seen: bool = False
    canvas_times: list[float] = field(default_factory=list)
    canvas_passes: list[int] = field(default_factory=list)

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.canvas_times.append(time.perf_counter())
        self.canvas_passes.append(self.passes)

    def end(self) -> None:
        pass

    def on_decoder(self, *_: Any) -> None:
        self.passes += 1


def load_reference(model_dir: Path) -> Any:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def _generate(model: Any, ids: Any, mask: Any, settings: ReferenceSettings) -> tuple[Any, _Clock]:
    clock = _Clock()
    hook = model.model.decoder.register_forward_hook(clock.on_decoder)
    kwargs: dict[str, Any] = {
        "max_new_tokens": settings.max_new_tokens,
        "max_denoising_steps": settings.max_denoising_steps,
        "confidence_threshold": settings.confidence_threshold,
        "eos_token_id": None,
        "streamer": clock,
    }
    if mask is not None:
        kwargs["attention_mask"] = mask
    try:
        sequences = model.generate(ids, **kwargs).sequences
    finally:
        hook.remove()
    return sequences, clock


def _records(
    batch: Sequence[tuple[int, str, list[int]]],
    clock: _Clock,
    generated: int,
    started: float,
    finished: float,
    settings: ReferenceSettings,
    run_start: float,
) -> list[RequestRecord]:
    """One record per request of a generate() call (all rows share its timing)."""
    times, passes = clock.canvas_times, [0, *clock.canvas_passes]
    tokens = min(settings.max_new_tokens, generated)
    return [
        RequestRecord(
            index=index,
            prompt_name=name,
            start=started - run_start,
            latency=finished - started,
            ttft=times[0] - started if times else None,
            canvas_seconds=gaps(times),
            prompt_tokens=len(ids),
            output_tokens=tokens,
            finish_reason="length",
            steps_per_canvas=tuple(int(n) for n in gaps(passes)),
            decoder_passes=clock.passes,
            tokens_per_forward=tokens / clock.passes if clock.passes else None,
        )
        for index, name, ids in batch
    ]


def run_one_at_a_time(
    model: Any, prompts: Sequence[tuple[str, list[int]]], settings: ReferenceSettings
) -> tuple[list[RequestRecord], float]:
    """Each request alone, in order. Returns the records and the wall time of the run."""
    import torch

    records: list[RequestRecord] = []
    run_start = time.perf_counter()
    for index, (name, ids) in enumerate(prompts):
        torch.manual_seed(settings.seed + index)
        started = time.perf_counter()
        sequences, clock = _generate(model, torch.tensor([ids]), None, settings)
        finished = time.perf_counter()
        generated = sequences.shape[1] - len(ids)
        batch = [(index, name, ids)]
        records += _records(batch, clock, generated, started, finished, settings, run_start)
    return records, time.perf_counter() - run_start


def run_static_batches(
    model: Any,
    prompts: Sequence[tuple[str, list[int]]],
    batch_size: int,
    settings: ReferenceSettings,
    pad_token_id: int,
) -> tuple[list[RequestRecord], float]:
    """Batches of `batch_size` requests in order, left-padded. A request's latency is its
    batch's generate() time (all requests of a batch are taken to arrive together)."""
    import torch

    records: list[RequestRecord] = []
    run_start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        group = [
            (first + k, n, ids) for k, (n, ids) in enumerate(prompts[first : first + batch_size])
        ]
        width = max(len(ids) for _, _, ids in group)
        padded = [[pad_token_id] * (width - len(ids)) + ids for _, _, ids in group]
        mask = [[0] * (width - len(ids)) + [1] * len(ids) for _, _, ids in group]
        torch.manual_seed(settings.seed + first)
        started = time.perf_counter()
        sequences, clock = _generate(model, torch.tensor(padded), torch.tensor(mask), settings)
        finished = time.perf_counter()
        generated = sequences.shape[1] - width
        records += _records(group, clock, generated, started, finished, settings, run_start)
    return records, time.perf_counter() - run_start


def warm_up(model: Any, ids: list[int], settings: ReferenceSettings) -> None:
    """One short generate() so that first-call costs (allocations, lazy init) are not timed."""
    import torch

    _generate(model, torch.tensor([ids]), None, settings)
