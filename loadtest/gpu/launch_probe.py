"""The launch-cost probe: host time per call of every kernel launcher a real engine step makes
(a denoise step of one canvas through the runner and the batched sampler, at the benchmark's
toy shapes, first layers through the first full-attention one), with the GPU kept busy before
each step so that the host's time is the launch's, not a wait for the queue. On a CPU the
same probe times the twins' and the native kernels' calls (dispatch and, at these shapes, their
little work: a CPU runs a kernel inside its call). Its median is what one launch costs the host:
`python -m loadtest.gpu.roofline --measured-launch` predicts with it (`Hardware.with_launch`)
instead of the datasheet-like constant. The first run's launch stage (`loadtest.gpu.first_run`)
shares its tools: the kernel set wrapped, the GPU kept busy."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from engine.model import DiffusionLM
from kernels import KernelSet

# Timed steps after the warm one (which compiles and allocates).
ROUNDS = 3
BUSY_CYCLES = 200_000_000  # `torch.cuda._sleep` ahead of a step: the GPU stays busy (~0.1 s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def busy(device: torch.device) -> None:
    """Keep the GPU busy for a while, so that host timings see launches, not the queue."""
    if device.type == "cuda":
        torch.cuda._sleep(BUSY_CYCLES)


# -- kernels wrapped in a step -------------------------------------------------------------------


def kernel_names(ks: KernelSet) -> list[str]:
    """The kernels a set binds (every callable field)."""
    skip = {"backend", "exact", "prepare"}
    return [f.name for f in fields(KernelSet) if f.name not in skip and getattr(ks, f.name)]


def wrapped(ks: KernelSet, names: list[str], wrap: Callable[[str, Any], Any]) -> KernelSet:
    return replace(ks, **{n: wrap(n, getattr(ks, n)) for n in names})


@contextmanager
def bound(model: DiffusionLM, ks: KernelSet) -> Iterator[None]:
    """`model` runs with `ks` inside the block, then its own kernels again."""
    own = model.kernels
    model.bind_kernels(ks)
    try:
        yield
    finally:
        model.bind_kernels(own)


@dataclass(frozen=True, slots=True)
class LaunchCost:
    """What the probe measured: the median host seconds of one launcher call over `calls`
    calls on `device` with `kernels` (`KernelSet.describe`), and each kernel's median in µs."""

    device: str
    kernels: str
    per_call_s: float
    calls: int
    per_kernel_us: dict[str, float]

    def line(self) -> str:
        worst = max(self.per_kernel_us.items(), key=lambda kv: kv[1], default=("none", 0.0))
        return (
            f"{self.per_call_s * 1e6:.1f} µs per launcher call on {self.device} ({self.kernels}; "
            f"median of {self.calls} calls of {len(self.per_kernel_us)} kernels, slowest "
            f"{worst[0]} {worst[1]:.1f} µs)"
        )


def timer(seconds: dict[str, list[float]]) -> Callable[[str, Any], Any]:
    """A `wrapped` wrapper: each call of kernel `name` appends its host seconds to
    `seconds[name]`."""

    def timed(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            seconds.setdefault(name, []).append(time.perf_counter() - start)
            return out

        return call

    return timed


def measure(model: DiffusionLM, step: Callable[[], None], rounds: int = ROUNDS) -> LaunchCost:
    """Time every call of `model`'s bound kernels over `rounds` runs of `step` (after one
    untimed run), each queued behind a busy GPU."""
    device = model.embed_tokens.weight.device
    kernels = model.kernels
    seconds: dict[str, list[float]] = {}
    timed = timer(seconds)

    step()
    sync(device)
    with bound(model, wrapped(kernels, kernel_names(kernels), timed)):
        for _ in range(rounds):
            busy(device)
            step()
    sync(device)
    every = [s for values in seconds.values() for s in values]
    if not every:
        raise RuntimeError("the probe's step called no bound kernel")
    per_kernel = {name: statistics.median(s) * 1e6 for name, s in seconds.items()}
    return LaunchCost(
        device.type, kernels.describe(), statistics.median(every), len(every), per_kernel
    )
