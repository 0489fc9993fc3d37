"""Canvas kernels. `kernels.reference` holds the PyTorch twin of every kernel; the Triton
versions (CUDA) come with the same signatures. `ops()` returns the implementation the engine
uses: the twins on CPU or when `CANVAS_FORCE_TWINS=1`."""

from __future__ import annotations

import os
from types import ModuleType

from kernels import reference


def twins_forced() -> bool:
    return os.environ.get("CANVAS_FORCE_TWINS", "0") not in ("", "0", "false", "False")


def ops(device_type: str) -> ModuleType:
    """The kernel module for a device type ("cpu", "cuda")."""
    del device_type  # only the twins exist so far; Triton kernels plug in here for "cuda"
    return reference


__all__ = ["ops", "reference", "twins_forced"]
