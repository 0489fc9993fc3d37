"""Each row kind's share of a step's forward outputs: the batches `Engine` samples, one per
kind present (`engine.rows`)."""

from __future__ import annotations

import numpy as np
import torch

from engine.device.cuda import to_device
from engine.rows import KindBatch, RowSpec
from engine.runner import EncodeInput, RunOutput
from engine.sampling import CanvasBatch, Sampling
from engine.types import ScheduledRow, StepStats


def kind_batches(
    rows: list[ScheduledRow],
    specs: list[RowSpec],
    inputs: list[EncodeInput],
    canvas: CanvasBatch | None,
    out: RunOutput,
    sampling: Sampling,
    stats: StepStats,
) -> dict[RowSpec, tuple[KindBatch, list[int]]]:
    """The rows of each kind present, with their plan positions and their share of the
    forward's outputs: DECODE rows' logits (all DECODE rows share one canvas batch, so one
    DECODE kind), ENCODE rows' last-position logits (those that asked), verify passes'
    per-position logits."""
    where: dict[RowSpec, list[int]] = {}
    last: dict[int, int] = {}  # plan position -> row of out.last_logits
    verify: dict[int, torch.Tensor] = {}
    encoded = iter(inputs)  # the ENCODE rows' inputs, in plan order
    for i, spec in enumerate(specs):
        where.setdefault(spec, []).append(i)
        step_input = None if spec.decode else next(encoded)
        if step_input is not None and step_input.verify:
            verify[i] = (out.verify_logits or [])[len(verify)]
        elif step_input is not None and step_input.wants_last_logits:
            last[i] = len(last)
    assert sum(spec.decode for spec in where) <= 1, "one DECODE kind per step"
    batches = {}
    for spec, positions in where.items():
        logits = out.denoise_logits if spec.decode else None
        picked = [last[i] for i in positions if i in last]
        if picked:
            assert out.last_logits is not None
            logits = out.last_logits
            if picked != list(range(out.last_logits.shape[0])):
                logits = logits[to_device(np.array(picked, dtype=np.int64), logits.device)]
        rows_of_kind = [rows[i] for i in positions]
        verify_logits = tuple(verify[i] for i in positions if i in verify)
        kind_canvas = canvas if spec.decode else None
        batch = KindBatch(rows_of_kind, sampling, stats, logits, kind_canvas, verify_logits)
        batches[spec] = (batch, positions)
    return batches
