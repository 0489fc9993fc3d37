"""Shared fixtures: tiny random-weight checkpoints built once per session with the reference
classes, and the reference model loaded from them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Every engine the tests build (and every server they start) checks its scheduler's accounting
# after each step: a leaked page or sampler slot fails the test that leaked it.
os.environ.setdefault("CANVAS_CHECK_INVARIANTS", "1")

import pytest
import torch

from engine.testing import PRESETS, make_tiny

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_checkpoint(preset) -> directory of a tiny checkpoint (built once per preset)."""
    built: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in built:
            built[preset] = make_tiny(tmp_path_factory.mktemp(f"tiny-{preset}"), preset)
        return built[preset]

    return get


@pytest.fixture(scope="session")
def reference_model() -> Callable[[Path], torch.nn.Module]:
    """reference_model(dir) -> DiffusionGemmaForBlockDiffusion loaded from `dir` (cached)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    loaded: dict[Path, torch.nn.Module] = {}

    def get(path: Path) -> torch.nn.Module:
        if path not in loaded:
            loaded[path] = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
        return loaded[path]

    return get


# The tiny test presets (`bench-small` is a benchmark checkpoint, too big for per-seed parity).
ALL_PRESETS = sorted(name for name in PRESETS if name != "bench-small")
