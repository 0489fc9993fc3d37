"""Canvas kernels. `kernels.reference` holds the PyTorch twin of every kernel; the Triton
versions (CUDA) have the same names and signatures. `ops()` returns the implementation the
engine uses: the Triton kernels on CUDA, the twins on CPU, when `CANVAS_FORCE_TWINS=1`, or when
triton is not installed. `CANVAS_TRITON_ON_CPU=1` selects the Triton kernels on CPU too (tests
only: it needs `TRITON_INTERPRET=1`). Triton is imported lazily, so CPU-only installs import this
package without it."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from kernels import reference

# Each module exports KERNELS: its launchers, named exactly as their twins in `reference`.
TRITON_MODULES = ("kernels.triton_attention", "kernels.triton_moe", "kernels.triton_sampler")


def twins_forced() -> bool:
    return os.environ.get("CANVAS_FORCE_TWINS", "0") not in ("", "0", "false", "False")


def triton_on_cpu() -> bool:
    """True when `CANVAS_TRITON_ON_CPU=1`: `ops("cpu")` returns the Triton kernels (meaningful
    only with TRITON_INTERPRET=1, which runs them in Triton's CPU interpreter)."""
    return os.environ.get("CANVAS_TRITON_ON_CPU", "0") not in ("", "0", "false", "False")


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def ops(device_type: str) -> ModuleType:
    """The kernel module for a device type ("cpu", "cuda"). On CUDA with triton installed and
    the twins not forced: a module with every twin's name, bound to the Triton launcher where
    one exists and to the twin otherwise. On CPU: the twins, unless `CANVAS_TRITON_ON_CPU=1`."""
    wanted = device_type == "cuda" or (device_type == "cpu" and triton_on_cpu())
    if not wanted or twins_forced() or not triton_available():
        return reference
    return triton_ops()


@functools.cache
def triton_ops() -> ModuleType:
    """The Triton implementations (twins where none exists), whatever the device: `ops` uses it
    on CUDA; tests and the benchmark's dry run use it under TRITON_INTERPRET=1 on CPU."""
    module = ModuleType("kernels.triton_ops", "Triton kernels, twins where none exists.")
    public = {k: v for k, v in vars(reference).items() if not k.startswith("_")}
    module.__dict__.update(public)
    for name in TRITON_MODULES:
        for launcher in importlib.import_module(name).KERNELS:
            assert launcher.__name__ in public, f"{name}.{launcher.__name__} has no twin"
            setattr(module, launcher.__name__, launcher)
    return module


def expect(
    tensor: torch.Tensor,
    name: str,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> None:
    """Launcher check: rank, sizes (None = any), dtype, device, and a unit stride in the last
    dimension (the kernels address rows through strides but read each row as one vector)."""
    assert tensor.dim() == len(shape), f"{name}: expected {len(shape)} dims, got {tensor.dim()}"
    for dim, (want, got) in enumerate(zip(shape, tensor.shape, strict=True)):
        assert want is None or want == got, f"{name}: dim {dim} is {got}, expected {want}"
    assert tensor.dtype in dtypes, f"{name}: dtype {tensor.dtype}, expected one of {dtypes}"
    assert tensor.device == device, f"{name}: on {tensor.device}, expected {device}"
    assert tensor.shape[-1] <= 1 or tensor.stride(-1) == 1, f"{name}: last dim must be contiguous"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in full precision (parity with the twins); the default TF32 would
    lose ~3 decimal digits. bf16/fp16 operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


__all__ = [
    "dot_precision",
    "expect",
    "interpreting",
    "ops",
    "reference",
    "triton_available",
    "triton_on_cpu",
    "triton_ops",
    "twins_forced",
]
