"""The token-expert pairs of a step sorted by expert (`moe.c`'s counting sort), which the fp32
and the bf16 expert tiles (`kernels.native.moe`, `kernels.native.bf16`) both run over."""

from __future__ import annotations

import torch

from kernels.native.args import MoeSortArgs
from kernels.native.build import loaded


def sort_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, ends) of ids [N, K]: the pair indices (token * K + slot) sorted by expert, each
    expert's in pair order, and each expert's end row (int64). IndexError naming the ids that
    are no expert's."""
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()
    pairs = torch.empty_like(flat_ids)
    ends = torch.empty(num_experts, dtype=torch.int64)
    sort = MoeSortArgs(
        ids=flat_ids.data_ptr(),
        num_pairs=pairs.numel(),
        num_experts=num_experts,
        pairs=pairs.data_ptr(),
        ends=ends.data_ptr(),
    )
    if loaded("moe").canvas_moe_sort(sort):
        bad = flat_ids[(flat_ids < 0) | (flat_ids >= num_experts)].unique()[:8].tolist()
        raise IndexError(f"expert ids must be in [0, {num_experts}), got {bad}")
    return pairs, ends
