"""The logits processors of a fast-numerics step (`engine.logits.processors` says what each
does): every row's knobs are read from the batched sampler's slots on the device, the
bias and the penalties are applied row by row, and the filters over runs of consecutive rows
that filter, in place (`engine.logits.filters`: a chunk of positions at a time)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from engine.logits.filters import filter_logits_
from engine.logits.processors import (
    add_bias_,
    filters,
    penalise_,
    penalises,
    token_counts,
)
from engine.request import RequestState


def runs(rows: list[int]) -> Iterator[tuple[int, int]]:
    """Maximal runs [start, stop) of consecutive indices in ascending `rows`."""
    start = prev = None
    for row in rows:
        if prev is not None and row == prev + 1:
            prev = row
            continue
        if start is not None and prev is not None:
            yield start, prev + 1
        start = prev = row
    if start is not None and prev is not None:
        yield start, prev + 1


@torch.inference_mode()  # the step's logits are inference tensors: written in place
def process_rows_(
    logits: torch.Tensor,
    length: int,
    reqs: list[RequestState],
    slots: torch.Tensor,
    knobs: Mapping[str, torch.Tensor],
    bias_ids: torch.Tensor,
) -> None:
    """Process logits [R * length, V] (row r: `reqs[r]`'s positions, its slot `slots[r]`) in
    place. `knobs`: the slots' knob tensors by name (top_p's holds the floor; logit_bias's
    [S, MAX_LOGIT_BIAS] the biases, whose token ids are `bias_ids`, in the request's order).
    Which processors run comes from the requests on the host: no device sync."""
    view = logits.view(-1, length, logits.shape[-1])  # [R, length, V]
    for r, req in enumerate(reqs):
        # [1], not a 0-d index: indexing by a 0-d tensor reads it on the host (a sync)
        params, slot = req.params, slots[r : r + 1]
        if params.logit_bias:
            num = len(params.logit_bias)
            add_bias_(view[r], bias_ids[slot, :num][0], knobs["logit_bias"][slot, :num][0])
        if penalises(params):
            penalise_(
                view[r],
                token_counts(req, logits.device),
                knobs["repetition_penalty"][slot],
                knobs["frequency_penalty"][slot],
                knobs["presence_penalty"][slot],
            )
    rows = [r for r, req in enumerate(reqs) if filters(req.params)]
    max_k = max((reqs[r].params.top_k for r in rows), default=0)
    any_p = any(reqs[r].params.top_p < 1 for r in rows)
    any_min_p = any(reqs[r].params.min_p > 0 for r in rows)
    for start, stop in runs(rows):
        picked = slots[start:stop]

        def per_position(name: str, picked: torch.Tensor = picked) -> torch.Tensor:
            return knobs[name][picked].repeat_interleave(length)  # [(stop - start) * length]

        filter_logits_(
            logits[start * length : stop * length],
            per_position("top_k"),
            per_position("top_p"),
            per_position("min_p"),
            max_k,
            any_p,
            any_min_p,
        )
