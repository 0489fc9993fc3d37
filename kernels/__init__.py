"""Canvas kernels. `kernels.reference` holds the PyTorch twin of every kernel; the Triton
versions (CUDA, `kernels.triton_*`) and the native C versions (CPU, `kernels.native`) have the
same names and signatures. `resolve_kernels()` picks, once at load, the `KernelSet` an engine
runs with — a backend by name from `kernels.backends.REGISTRY` ("twins", "native", "triton")
and a numerics (fast or exact) — and the model binds it onto its modules, so nothing looks a
kernel up per call. The Triton launchers read TRITON_INTERPRET per launch for their block
sizes (`interpreting`); the native kernels read CANVAS_NATIVE, CANVAS_CACHE and CC once, when
their libraries load. Triton is imported lazily, so CPU-only installs import this package
without it."""

from __future__ import annotations

from kernels import reference
from kernels.backends import BACKENDS, REGISTRY, register, resolve_kernels, triton_ops
from kernels.kernel_set import KernelSet
from kernels.support import dot_precision, expect, interpreting, triton_available

__all__ = [
    "BACKENDS",
    "REGISTRY",
    "KernelSet",
    "dot_precision",
    "expect",
    "interpreting",
    "reference",
    "register",
    "resolve_kernels",
    "triton_available",
    "triton_ops",
]
