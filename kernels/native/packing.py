"""Packed copies of a model's weights for the C kernels' register tiles (`moe.c`'s experts and
dense projections, `step.c`'s transposed router), kept by the kernel set bound onto that model:
`kernels.native.bind_packed` gives each binding (`KernelSet.for_model`) a `PackedWeights` of
its own, so a copy lives as long as the model's kernels, is made once, and no state is shared
between models or kept at module level."""

from __future__ import annotations

from collections.abc import Callable

import torch

Packed = tuple[torch.Tensor, ...]


def version(t: torch.Tensor) -> int:
    """The in-place version counter (-1 for an inference tensor, which has none: weights made
    under `torch.inference_mode` are taken as fixed)."""
    return -1 if t.is_inference() else t._version


class PackedWeights:
    """One binding's packed copies, by layout (`kind`) and the weights they come from. A copy
    is made at its first use and again only when a weight it comes from changes in place (a
    loaded checkpoint, a training step); the weights are held with their copies, so the memory
    a key names stays theirs."""

    def __init__(self, onednn: bool = False) -> None:
        """onednn: whether this binding's bf16 dense projections run oneDNN on weights reordered
        once (`kernels.native.onednn.decide`, when the binding is made)."""
        self.onednn = onednn
        self.copies: dict[tuple[object, ...], tuple[Packed, tuple[int, ...], Packed]] = {}

    def get(self, kind: str, weights: Packed, make: Callable[[], Packed]) -> Packed:
        """`make()`'s packed tensors of `weights`, made once while they are unchanged."""
        key = (kind, *((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in weights))
        versions = tuple(version(t) for t in weights)
        held = self.copies.get(key)
        if held is not None and held[1] == versions:
            return held[2]
        packed = make()
        self.copies[key] = (weights, versions, packed)
        return packed


def packed(
    packs: PackedWeights | None, kind: str, weights: Packed, make: Callable[[], Packed]
) -> Packed:
    """`make()` through the binding's store `packs`, or now where there is none (a kernel
    called outside a bound model: the tests, the tools)."""
    return make() if packs is None else packs.get(kind, weights, make)
