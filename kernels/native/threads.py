"""How a native kernel's rows split among threads, and which operands the native kernels take.

A kernel's rows go in one call to torch's own OpenMP team where the library shares torch's
runtime (`build.on_torch_team`), else in ranges to Python threads, each calling the kernel
without the GIL (ctypes releases it), one range each (`over_rows`)."""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kernels.native.build import on_torch_team

# Rows per thread below which one thread does all (a thread hand-off costs ~50 µs): sampler
# rows (a vocabulary each), and norm elements.
MIN_ROWS_PER_THREAD = 8
MIN_NORM_ELEMENTS_PER_THREAD = 1 << 16


def takes(*tensors: torch.Tensor | None) -> bool:
    """Whether the native kernels take these operands: fp32 CPU tensors, no autograd (training
    keeps the twins, whose intermediates autograd needs)."""
    if torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not all(<generator>): this runs a few dozen times per step
        if t is not None and (t.dtype is not torch.float32 or not t.is_cpu):
            return False
    return True


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for an argument struct (None: NULL)."""
    return None if t is None else t.data_ptr()


def addresses(**tensors: torch.Tensor | None) -> dict[str, int | None]:
    """Argument-struct fields by name: each tensor's data address (None: NULL)."""
    return {name: ptr(t) for name, t in tensors.items()}


def norm_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def norm_min_rows(hidden: int) -> int:
    """Rows of `hidden` elements per thread below which one thread does all."""
    return max(1, MIN_NORM_ELEMENTS_PER_THREAD // max(1, hidden))


def split_rows(
    name: str, fn: Callable[..., object], args: ctypes.Structure, num_rows: int, min_rows: int
) -> None:
    """fn(&args) over rows [0, num_rows), at least `min_rows` rows per thread: one call on
    torch's team (`on_torch_team(name)`), else `over_rows`' ranges on Python threads, each
    with its own copy of `args` (its `begin`, `end` and `threads` = 1)."""
    if on_torch_team(name):
        args.begin, args.end = 0, num_rows
        team = threads(num_rows, min_rows) if num_rows >= 2 * min_rows else 1
        args.threads = team
        fn(ctypes.byref(args))
        return

    def run(begin: int, end: int) -> None:
        part = type(args).from_buffer_copy(args)
        part.begin, part.end, part.threads = begin, end, 1
        fn(ctypes.byref(part))

    over_rows(run, num_rows, min_rows)


@functools.cache
def pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="canvas-native")


def threads(num_rows: int, min_rows: int) -> int:
    """torch's thread count, at most one thread per `min_rows` rows (at least one)."""
    return max(1, min(torch.get_num_threads(), num_rows // max(1, min_rows)))


def ranges(num_rows: int, min_rows: int) -> list[tuple[int, int]]:
    """`threads`' ranges of [0, num_rows), each holding rows."""
    count = threads(num_rows, min_rows)
    bounds = [num_rows * i // count for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def over_rows(run: Callable[[int, int], None], num_rows: int, min_rows: int) -> None:
    """run(begin, end) over [0, num_rows), split among torch's thread count (at least
    `min_rows` rows each): the others on pool threads, the first here."""
    if num_rows < 2 * min_rows:  # one thread's worth (an AR step's rows): no split to plan
        if num_rows:
            run(0, num_rows)
        return
    parts = ranges(num_rows, min_rows)
    if len(parts) > 1:
        futures = [pool(len(parts) - 1).submit(run, *r) for r in parts[1:]]
        run(*parts[0])
        for future in futures:
            future.result()
    elif parts:
        run(*parts[0])


_SCRATCH = threading.local()


def scratch(numel: int) -> torch.Tensor:
    """This thread's reusable fp32 buffer of at least `numel` elements. A fresh buffer of
    megabytes costs a page fault per 4 KiB page on its first writes; this one's pages stay
    mapped. Shared by the experts and attention: each is done with it before it returns."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]
