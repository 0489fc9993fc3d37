"""Kernel tests run the Triton kernels in Triton's CPU interpreter when there is no GPU
(TRITON_INTERPRET, set by tests/conftest.py before any test module is collected), and compiled
on the GPU otherwise. Modules that need triton skip cleanly without it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the parity sweeps run: the CPU under the interpreter, else the GPU."""
    from kernels import interpreting

    return torch.device("cpu" if interpreting() else "cuda")


@pytest.fixture
def fresh_native_library(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """The native kernels' tests (`native_cases.NATIVE`): each builds (or finds) the libraries
    under a cache of this session's own, loaded afresh."""
    from kernels.native import build

    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path_factory.getbasetemp() / "canvas-cache"))
    monkeypatch.delenv("CANVAS_NATIVE", raising=False)
    build.library.cache_clear()
    yield
    build.library.cache_clear()
