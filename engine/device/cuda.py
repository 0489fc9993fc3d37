"""CUDA specifics of the engine: which GPU a thread launches on, which errors a CUDA context
does not survive, and host memory that copies to the GPU without waiting.

Nothing here needs a GPU to import or to test: on other devices every helper does what the
code did before it (no device selection, plain host memory).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# Texts of the CUDA errors after which the context is unusable: every later kernel fails too
# (the CUDA runtime's "sticky" errors, cuBLAS failures, Triton's launch errors).
FATAL_ERROR_TEXTS = (
    "cuda error",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "device-side assert",
    "unspecified launch failure",
    "launch timed out",
    "cublas",
    "triton error [cuda]",
)


# Told of each host tensor that a copy to a device reads without waiting: every `host_buffer`
# (pinned on CUDA) and, on other devices, the host memory `to_device` moves (which CUDA would
# stage in one). Empty when serving; the roofline's accountant (`loadtest.gpu.accountant`)
# appends to it to tell, on the meta device where nothing can be pinned, the copies CUDA makes
# from pinned memory from those it makes from pageable memory.
STAGING_OBSERVERS: list[Callable[[torch.Tensor], None]] = []


def select_device(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device when it names one by index
    (`cuda:N`). Triton launches its kernels on the current device, whatever device their
    tensors are on (cuBLAS follows the tensors): on a thread whose current device is another,
    a Triton kernel reads device-N memory from device 0. The current device is per thread, so
    both the thread that loads the model and the step loop's thread call this. Nothing for
    `cuda` (the current device, whichever it is) or any other device type."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)


def fatal_device_error(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a CUDA error that leaves the
    context unusable: a `torch.AcceleratorError`, or a RuntimeError whose text names a CUDA,
    cuBLAS or Triton launch failure (`FATAL_ERROR_TEXTS`); or one that says it ends the engine
    (`ends_engine`: a parallel model's broken world, `engine.parallel.world`). Out of memory is
    otherwise never fatal: it fails the step that asked, and the next one may fit."""
    seen: BaseException | None = exc
    while seen is not None:
        text = str(seen).lower()
        if getattr(seen, "ends_engine", False):
            return True
        if isinstance(seen, torch.cuda.OutOfMemoryError) or "out of memory" in text:
            return False
        if isinstance(seen, torch.AcceleratorError):
            return True
        if isinstance(seen, RuntimeError) and any(t in text for t in FATAL_ERROR_TEXTS):
            return True
        seen = seen.__cause__
    return False


def host_buffer(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """An empty host tensor that stages inputs for `device`: pinned (page-locked) when the
    device is CUDA, so that a `non_blocking` copy from it is asynchronous (from pageable memory
    CUDA may wait for the stream to stage the copy itself); plain memory otherwise. Pinned
    blocks come from torch's caching host allocator, which reuses a block only once the copies
    queued from it have run, so a buffer may be dropped as soon as its copy is queued."""
    pin = torch.device(device).type == "cuda"
    buffer = torch.empty(shape, dtype=dtype, pin_memory=pin)
    for observe in STAGING_OBSERVERS:
        observe(buffer)
    return buffer


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`array` as a tensor on `device`, moved by a copy that does not wait for the GPU: staged
    in a pinned `host_buffer` when the device is CUDA; on a CPU the array's own memory, as
    `torch.from_numpy` gives it (no copy)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        for observe in STAGING_OBSERVERS:
            observe(host)
        return host.to(device, non_blocking=True)
    staged = host_buffer(tuple(host.shape), host.dtype, device)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)
