"""What the `torch.library` custom ops of `kernels.ops` and `kernels.ops_step` share: the
implementation each device gets, and the fake (meta) outputs built from shapes alone.

An op's implementation is the twin (`kernels.reference`, fast numerics) on every device but
CUDA, where it is the Triton launcher of the same name when triton is installed (the twin
otherwise). Its fake implementation allocates outputs of the right shapes and dtypes and
computes nothing, so a step runs on the meta device and traces without a graph break.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

import kernels.reference as reference
from kernels.support import triton_available


def cuda_impl(module: str, name: str) -> object:
    """The CUDA implementation of the kernel `name`: `kernels.<module>`'s Triton launcher
    (imported on first use, so importing the ops never imports triton), else the twin."""
    if not triton_available():
        return getattr(reference, name)
    return getattr(importlib.import_module(f"kernels.{module}"), name)


def fake(
    like: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A contiguous output of `shape` on `like`'s device, in `dtype` (default: `like`'s)."""
    return like.new_empty(tuple(shape), dtype=dtype or like.dtype)


def fake_sample(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four per-position outputs of a sampler op (`reference.SampleResult`'s fields:
    sample and argmax int64, entropy and lse fp32) for logits [P, V]."""
    num_positions = logits.shape[0]
    ints = [fake(logits, (num_positions,), torch.int64) for _ in range(2)]
    return (*ints, *(fake(logits, (num_positions,), torch.float32) for _ in range(2)))
