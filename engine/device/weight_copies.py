"""What the bound native CPU kernels copy of a model's weights once each has run: counted by the
memory plan (`engine.device.memory`) beside the weights it shares the rest out after."""

from __future__ import annotations

from engine.model import DiffusionLM
from engine.model.layers import Attention, GatedMLP
from kernels.native import onednn


def packed_bytes(model: DiffusionLM) -> int:
    """What `model`'s bound native CPU kernels hold beside its weights once each has run: a
    copy of each bf16 dense projection (attention's and the gated MLPs'), reordered for oneDNN
    or packed for the tiles (`kernels.native.onednn.held_bytes`); 0 under other kernels."""
    if not model.kernels.native:
        return 0
    dense = [
        proj.weight
        for module in model.modules()
        if isinstance(module, (Attention, GatedMLP))
        for name in module.FP8_PARAMS
        if (proj := getattr(module, name.removesuffix(".weight"))) is not None
    ]
    return onednn.held_bytes(dense)
