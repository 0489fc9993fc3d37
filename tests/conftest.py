"""Shared fixtures: tiny random-weight checkpoints built once per session with the reference
classes, and the reference model loaded from them.

The suite never writes into the user's home: before anything can read them (this module is
imported before every test module, and before torch, transformers or triton), HOME and every
cache and config location the project and its libraries use point into one temporary
directory per session, removed when the session ends."""

from __future__ import annotations

import os
import shutil
import tempfile

SESSION_HOME = tempfile.mkdtemp(prefix="canvas-tests-home-")
# Each location named for the libraries that read it; HOME itself catches any other.
SESSION_ENV = {
    "HOME": SESSION_HOME,
    "CANVAS_CACHE": os.path.join(SESSION_HOME, "canvas-cache"),  # built checkpoints
    "XDG_CACHE_HOME": os.path.join(SESSION_HOME, ".cache"),  # torch hub, helm, selenium
    "XDG_CONFIG_HOME": os.path.join(SESSION_HOME, ".config"),  # matplotlib, helm, chromium
    "XDG_DATA_HOME": os.path.join(SESSION_HOME, ".local", "share"),
    "HF_HOME": os.path.join(SESSION_HOME, ".cache", "huggingface"),  # transformers, hub
    "TRITON_HOME": SESSION_HOME,  # triton's ~/.triton (kernel cache)
    "MPLCONFIGDIR": os.path.join(SESSION_HOME, ".config", "matplotlib"),
}
os.environ.update(SESSION_ENV)
# Every engine the tests build (and every server they start) checks its scheduler's accounting
# after each step: a leaked page or sampler slot fails the test that leaked it.
os.environ.setdefault("CANVAS_CHECK_INVARIANTS", "1")

from collections.abc import Callable  # noqa: E402  (after the environment is set)
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton fixes interpreted or compiled mode when it first defines a kernel (its own
# `triton.language` included), so without a GPU the CPU interpreter is chosen here, before any
# test module is collected: a module that imports triton on the way (through loadtest.gpu, say)
# would otherwise fix compiled mode for the whole session, the kernel tests included.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.checkpoints.tiny import PRESETS, make_tiny  # noqa: E402

torch.set_num_threads(2)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


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


# The tiny test presets (`bench-small` and `bench-tiny` are benchmark checkpoints: the first is
# too big for per-seed parity, the second repeats what c32-window covers, at 3x its cost).
ALL_PRESETS = sorted(name for name in PRESETS if not name.startswith("bench-"))


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with a working vision tower, written by `canvas make-tiny --vision`."""
    from server.cli import main

    out = tmp_path_factory.mktemp("tiny-vision") / "checkpoint"
    assert main(["make-tiny", str(out), "--vision"]) == 0
    return out
