"""Native CPU kernels: C compiled at first use with the system compiler, called through ctypes.

The CPU fast path's twins are sequences of ATen operations, each one pass over its tensors.
Where a kernel makes many passes over a large tensor the passes, not the arithmetic, cost the
time: the diffusion sampler makes about fifteen over the [positions, vocabulary] logits (on
`bench-small`, 8 M logits per step at 16 canvases, ~90 ms of a ~525 ms step). `sampler.c` does
the same per row in three passes that stay in the core's cache.

Build: `cc -O3 -march=native -shared` (the compiler from $CC, else `cc`) into
$CANVAS_CACHE/native (default ~/.cache/canvas/native), named by a hash of the source, the flags
and the machine, once per machine (~1 s); a build that fails, or a machine without a compiler,
leaves the twins bound (one warning), and `CANVAS_NATIVE=0` turns the native kernels off.
No OpenMP: the rows are split among `torch.get_num_threads()` Python threads, each calling the
kernel without the GIL (ctypes releases it), so torch's OpenMP runtime stays the only one.

Numerics: the kernel's `exp` is a polynomial (~1 ulp) and its sums run in another order, so its
values differ from the twin's in the last bits; a sample differs only where u falls within that
rounding of a boundary between two tokens (tested: `tests/kernels/test_native_sampler.py`).
Rows are independent, so a row's results never depend on its batch. Fast numerics only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kernels.reference_sampler import SampleResult

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "sampler.c"
# No -ffast-math or -fassociative-math: the kernel's vector code fixes the order of every sum
# (a row's bits never depend on its address, so never on its batch) and its NaN checks stay.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99", "-fno-math-errno")
# Rows per thread below which one thread does all (a thread hand-off costs ~50 µs).
MIN_ROWS_PER_THREAD = 8


def enabled() -> bool:
    return os.environ.get("CANVAS_NATIVE", "1") not in ("0", "false", "False", "")


def _cache_dir() -> Path:
    root = Path(os.environ.get("CANVAS_CACHE", Path.home() / ".cache" / "canvas"))
    return root / "native"


def _compiler() -> str | None:
    name = os.environ.get("CC", "cc")
    return shutil.which(name)


def build(source: Path = SOURCE, out_dir: Path | None = None) -> Path:
    """The shared library of `source`, compiled unless this machine already has it. Raises
    RuntimeError when no compiler is found or the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not found)")
    code = source.read_bytes()
    key = hashlib.sha256(
        b"\0".join([code, " ".join(FLAGS).encode(), compiler.encode(), _machine().encode()])
    ).hexdigest()[:16]
    directory = out_dir or _cache_dir()
    library = directory / f"{source.stem}-{key}.so"
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name, then renamed: a concurrent build never loads half a file.
    fd, staging = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        command = [compiler, *FLAGS, str(source), "-o", staging, "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(staging, library)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return library


def _machine() -> str:
    """What `-march=native` compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return platform.machine() + "\n" + "\n".join(lines)
    except OSError:
        return platform.machine() + platform.processor()


_PTR = ctypes.c_void_p
_I64 = ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded sampler library, or None (twins stay bound) when disabled or unbuildable."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU sampler unavailable, using the PyTorch twin: %s", exc)
        return None
    fn = lib.canvas_sample_rows
    fn.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR]
    fn.restype = None
    return lib


def available() -> bool:
    return library() is not None


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="canvas-native")


def _ranges(num_rows: int) -> list[tuple[int, int]]:
    threads = max(1, min(torch.get_num_threads(), num_rows // MIN_ROWS_PER_THREAD))
    bounds = [num_rows * i // threads for i in range(threads + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _sample_into(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, probs: torch.Tensor
) -> SampleResult:
    lib = library()
    assert lib is not None, "native kernels are bound only when the library loads"
    num_positions, vocab = logits.shape
    assert logits.device.type == "cpu" and logits.dtype == torch.float32, "fp32 CPU logits"
    logits = logits.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float32).contiguous()
    assert temperature.shape == (num_positions,) and uniform.shape == (num_positions,)
    result = SampleResult(
        sample=torch.empty(num_positions, dtype=torch.int64),
        argmax=torch.empty(num_positions, dtype=torch.int64),
        entropy=torch.empty(num_positions, dtype=torch.float32),
        lse=torch.empty(num_positions, dtype=torch.float32),
    )
    pointers = [
        t.data_ptr() for t in (logits, temperature, uniform, probs, result.sample, result.argmax)
    ]
    fixed = (pointers[0], vocab, pointers[1], pointers[2])
    tail = (pointers[3], pointers[4], pointers[5], result.entropy.data_ptr(), result.lse.data_ptr())

    def run(rows: tuple[int, int]) -> None:
        lib.canvas_sample_rows(*fixed, rows[0], rows[1], *tail)

    ranges = _ranges(num_positions)
    if len(ranges) > 1:  # the others on pool threads, the first one here
        futures = [_pool(len(ranges) - 1).submit(run, r) for r in ranges[1:]]
        run(ranges[0])
        for future in futures:
            future.result()
    elif ranges:
        run(ranges[0])
    return result


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> SampleResult:
    """`reference.fused_sample`, natively (see the module docstring for the numerics)."""
    probs = torch.empty(logits.shape, dtype=torch.float32)
    return _sample_into(logits, temperature, uniform, probs)


def sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> tuple[SampleResult, torch.Tensor]:
    """`reference.sample_and_embed`, natively: the sampler's probabilities, then one GEMM."""
    probs = torch.empty(logits.shape, dtype=torch.float32)
    result = _sample_into(logits, temperature, uniform, probs)
    soft = logits.new_empty(logits.shape[0], weight.shape[1], dtype=weight.dtype)
    torch.matmul(probs.to(weight.dtype), weight, out=soft)  # the twin's GEMM call, its bits
    return result, soft * torch.tensor(scale, dtype=weight.dtype)
