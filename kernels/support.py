"""What the kernel modules share: whether triton is installed or interpreted, the launchers'
operand check and the dot products' precision. Imports nothing of Canvas, so every kernel
module imports it without reaching back into the `kernels` package."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

import torch


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1). Read per
    launch for block sizes; triton fixes the mode for the process when it defines a kernel."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


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
