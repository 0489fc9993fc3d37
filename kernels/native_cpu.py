"""Native CPU kernels: C compiled at first use with the system compiler, called through ctypes.

The CPU fast path's twins are sequences of ATen operations, each one pass over its tensors.
Where a kernel makes many passes over a large tensor the passes, not the arithmetic, cost the
time. `native/sampler.c`: the diffusion sampler makes about fifteen passes over the
[positions, vocabulary] logits (a large share of a canvas step on a CPU); the C kernel does
each row in three passes that stay in the core's cache.
`native/norms.c`: RMSNorm and a layer's norm tails (`add_rms_norm`, `rms_norm_pair`,
`close_layer`: 3 to 10 passes over the [tokens, hidden] activations each) one row at a time,
also bound for attention's per-head q/k/v norms and the router's norm, where at an AR step's few
rows `F.rms_norm`'s ~8 dispatches cost more than the arithmetic. `native/moe.c` (bound from
`kernels.native_moe`): one token's experts (an AR step at one request) in one call instead of
~10 dispatches per expert, and many tokens' experts as register-tiled products on packed
weights where the experts fit a core's L2 cache.

Build: `cc -O3 -march=native -shared -fopenmp` (the compiler from $CC, else `cc`; without
-fopenmp where that fails) into $CANVAS_CACHE/native (default ~/.cache/canvas/native), named by
a hash of the source, its headers, the flags and the machine, once per machine (~1 s each); a
build that fails, or a machine without a
compiler, leaves the twins bound (one warning), and `CANVAS_NATIVE=0` turns them off. Bound by
`resolve_kernels("cpu")` (`--kernels auto`) in fast numerics; `--kernels twins` and exact
numerics never use them; grad mode and non-fp32 operands fall back to the twins per call.
Threads: a kernel's rows are split into `torch.get_num_threads()` ranges run by torch's own
OpenMP team (`native/parallel.h`): a library built with -fopenmp needs libgomp.so.1, which is
torch's, already loaded, so no second runtime starts (`one_openmp_runtime` checks; then the
ranges go to Python threads calling the kernels without the GIL, as before OpenMP, which lose
the other cores to torch's workers spinning after each of torch's parallel regions).

Numerics: the kernels' `exp` is a polynomial (~1 ulp) and their sums run in another (fixed)
order, so their values differ from the twins' in the last bits; a sample differs only where u
falls within that rounding of a boundary between two tokens. Rows are independent and every
sum runs in the same order whatever a row's address, so a row's results never depend on its
batch (tested: `tests/kernels/test_native_cpu.py`).
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
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kernels import reference
from kernels.reference_sampler import SampleResult

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "sampler.c"
# No -ffast-math or -fassociative-math: the kernel's vector code fixes the order of every sum
# (a row's bits never depend on its address, so never on its batch) and its NaN checks stay.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99", "-fno-math-errno")
# Rows per thread below which one thread does all (a thread hand-off costs ~50 µs): sampler
# rows (a vocabulary each), and norm elements.
MIN_ROWS_PER_THREAD = 8
MIN_NORM_ELEMENTS_PER_THREAD = 1 << 16


def enabled() -> bool:
    return os.environ.get("CANVAS_NATIVE", "1") not in ("0", "false", "False", "")


def _cache_dir() -> Path:
    root = Path(os.environ.get("CANVAS_CACHE", Path.home() / ".cache" / "canvas"))
    return root / "native"


def _compiler() -> str | None:
    name = os.environ.get("CC", "cc")
    return shutil.which(name)


def build(source: Path = SOURCE, out_dir: Path | None = None, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of `source` (compiled with FLAGS and `extra`), compiled unless this
    machine already has it. Raises RuntimeError when no compiler is found or the build fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not found)")
    # the source and the headers it may include (parallel.h)
    code = b"".join(p.read_bytes() for p in (source, *sorted(source.parent.glob("*.h"))))
    key = hashlib.sha256(
        b"\0".join(
            [code, " ".join((*FLAGS, *extra)).encode(), compiler.encode(), _machine().encode()]
        )
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
        command = [compiler, *FLAGS, *extra, str(source), "-o", staging, "-lm"]
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


# Each library's functions: name -> argument types (all return nothing).
_F32 = ctypes.c_float
SIGNATURES: dict[str, dict[str, list[type]]] = {
    "sampler": {"canvas_sample_rows": [_PTR, _I64, _PTR, _PTR, _I64, _I64, *[_PTR] * 5, _I64]},
    "norms": {
        "canvas_rms_norm": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _F32, _I64],
        "canvas_rms_norm_pair": [*[_PTR] * 5, _I64, _I64, _I64, _F32, _I64],
        "canvas_close_layer": [*[_PTR] * 7, _I64, _PTR, _I64, _I64, _I64, _F32, _I64],
    },
    "moe": {
        "canvas_moe_token": [*[_PTR] * 7, _I64, _I64, _I64, _I64],
        "canvas_moe_rows": [*[_PTR] * 8, *[_I64] * 6],
        "canvas_moe_rows_parallel": [*[_PTR] * 8, *[_I64] * 6],
        "canvas_linear": [*[_PTR] * 3, *[_I64] * 5],
        "canvas_gated_linear": [*[_PTR] * 3, *[_I64] * 5],
        "canvas_linear_split": [*[_PTR] * 5, *[_I64] * 7],
        "canvas_moe_sort": [_PTR, _I64, _I64, _PTR, _PTR],
        "canvas_moe_sum": [_PTR, _PTR, *[_I64] * 5],
    },
    "attention": {"canvas_attention": [*[_PTR] * 13, *[_I64] * 7, _F32, *[_I64] * 4]},
    "step": {
        "canvas_qkv_norm_rope": [*[_PTR] * 10, *[_I64] * 3, _F32, *[_I64] * 3],
        "canvas_route": [*[_PTR] * 6, *[_I64] * 4, _F32, *[_I64] * 3],
        "canvas_geglu": [*[_PTR] * 3, *[_I64] * 3],
        "canvas_philox_uniform": [*[_PTR] * 3, _I64],
    },
}
# Functions returning an int64 (the rest return nothing).
_RETURNS_I64 = {
    "canvas_moe_lanes",
    "canvas_moe_sort",
    "canvas_attention_lanes",
    "canvas_step_lanes",
    *(f"canvas_{name}_openmp" for name in SIGNATURES),
}


@functools.cache
def library(name: str = "sampler") -> ctypes.CDLL | None:
    """The loaded library `native/<name>.c`, or None (the twins stay bound) when disabled or
    unbuildable."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(_build_with_openmp(name)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning(
            "native CPU kernels (%s) unavailable, using the PyTorch twins: %s", name, exc
        )
        return None
    for function in _RETURNS_I64:  # the no-argument ones (SIGNATURES' below keep theirs)
        if hasattr(lib, function):
            getattr(lib, function).argtypes, getattr(lib, function).restype = [], _I64
    for function, argtypes in SIGNATURES[name].items():
        fn = getattr(lib, function)
        fn.argtypes = argtypes
        fn.restype = _I64 if function in _RETURNS_I64 else None
    return lib


def _build_with_openmp(name: str) -> Path:
    """Every library is built with OpenMP where the compiler has it (its rows then split on
    torch's OpenMP team: `native/parallel.h`), else without."""
    source = SOURCE.with_name(f"{name}.c")
    try:
        return build(source, extra=("-fopenmp",))
    except (RuntimeError, subprocess.SubprocessError) as exc:
        logger.info("native %s without OpenMP: %s", name, exc)
    return build(source)


@functools.cache
def on_torch_team(name: str) -> bool:
    """Whether library `name` was built with OpenMP and shares torch's runtime: then its rows
    split on torch's team. Python threads of ours wait for the cores while torch's workers spin
    after each of torch's parallel regions, so right after a parallel torch op a split on
    Python threads can be slower than one thread, and torch's own team is the fastest
    (docs/performance.md has the measurements)."""
    lib = library(name)
    return (
        lib is not None and bool(getattr(lib, f"canvas_{name}_openmp")()) and one_openmp_runtime()
    )


def split_rows(
    name: str, fn: Callable[..., None], head: tuple, tail: tuple, num_rows: int, min_rows: int
) -> None:
    """fn(*head, begin, end, *tail, threads) over rows [0, num_rows), at least `min_rows` rows
    per thread: one call on torch's team (`on_torch_team(name)`), else `_over_rows`' ranges on
    Python threads, one thread each."""
    if on_torch_team(name):
        threads = _threads(num_rows, min_rows) if num_rows >= 2 * min_rows else 1
        fn(*head, 0, num_rows, *tail, threads)
    else:
        _over_rows(lambda begin, end: fn(*head, begin, end, *tail, 1), num_rows, min_rows)


def one_openmp_runtime() -> bool:
    """Whether this process maps at most one OpenMP runtime, so that an OpenMP library of ours
    shares torch's team rather than starting a second one beside it (which would fight torch's
    workers for the cores). Read from /proc/self/maps (Linux); False where unreadable."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    names = ("libgomp", "libiomp", "libomp")
    paths = {line.split()[-1] for line in maps.splitlines() if any(n in line for n in names)}
    return len(paths) <= 1


def available() -> bool:
    return all(library(name) is not None for name in SIGNATURES)


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="canvas-native")


def _threads(num_rows: int, min_rows: int) -> int:
    """torch's thread count, at most one thread per `min_rows` rows (at least one)."""
    return max(1, min(torch.get_num_threads(), num_rows // max(1, min_rows)))


def _ranges(num_rows: int, min_rows: int) -> list[tuple[int, int]]:
    """`_threads`' ranges of [0, num_rows), each holding rows."""
    threads = _threads(num_rows, min_rows)
    bounds = [num_rows * i // threads for i in range(threads + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _over_rows(run: Callable[[int, int], None], num_rows: int, min_rows: int) -> None:
    """run(begin, end) over [0, num_rows), split among torch's thread count (at least
    `min_rows` rows each): the others on pool threads, the first here."""
    if num_rows < 2 * min_rows:  # one thread's worth (an AR step's rows): no split to plan
        if num_rows:
            run(0, num_rows)
        return
    ranges = _ranges(num_rows, min_rows)
    if len(ranges) > 1:
        futures = [_pool(len(ranges) - 1).submit(run, *r) for r in ranges[1:]]
        run(*ranges[0])
        for future in futures:
            future.result()
    elif ranges:
        run(*ranges[0])


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

    split_rows("sampler", lib.canvas_sample_rows, fixed, tail, num_positions, MIN_ROWS_PER_THREAD)
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


# Packed copies of weights by their layout and the ids of the tensors they come from (an owner
# and the others packed with it: one weight may be packed alone and in a group): (a weak
# reference to the owner, the tensors' version counters, the packed tensors). An entry goes when
# its owner does, and is rebuilt when a tensor it was made from changes in place (model weights
# are never inference tensors, whose changes no counter records).
_PACKED: dict[tuple[object, ...], tuple[Any, ...]] = {}


def _version(t: torch.Tensor) -> int:
    """The in-place version counter (-1 for an inference tensor, which has none: weights made
    under `torch.inference_mode` are taken as fixed)."""
    return -1 if t.is_inference() else t._version


def _packed(
    owner: torch.Tensor,
    others: tuple[torch.Tensor, ...],
    make: Callable[[], tuple[Any, ...]],
    kind: str = "tiles",
) -> tuple[Any, ...]:
    """`make()`'s packed tensors of `owner` (and `others`), made once while they are unchanged;
    `kind` names the layout (one weight may have several). Used by `native_moe` (experts,
    projections) and `native_step` (the router)."""
    index = (kind, id(owner), *(id(t) for t in others))
    key = tuple(_version(t) for t in (owner, *others))
    cached = _PACKED.get(index)
    if cached is not None and cached[0]() is owner and cached[1] == key:
        return cached[2]
    packed = make()
    _PACKED[index] = (weakref.ref(owner, lambda _: _PACKED.pop(index, None)), key, packed)
    return packed


# -- norms (`norms.c`) -------------------------------------------------------------------------


def _native_norm(*tensors: torch.Tensor | None) -> bool:
    """Whether the native norms take these operands: fp32 CPU tensors, no autograd (training
    keeps the twins, whose intermediates autograd needs)."""
    if torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not all(<generator>): this runs a few dozen times per step
        if t is not None and (t.dtype is not torch.float32 or not t.is_cpu):
            return False
    return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _norm_rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _min_rows(hidden: int) -> int:
    return max(1, MIN_NORM_ELEMENTS_PER_THREAD // max(1, hidden))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.rms_norm_fused`, natively (fp32 CPU; the twin otherwise)."""
    if not _native_norm(x, weight) or x.numel() == 0:
        return reference.rms_norm_fused(x, weight, eps)
    return _norm(x, weight, None, eps)


def _norm(
    x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None, eps: float
) -> torch.Tensor:
    lib = library("norms")
    assert lib is not None, "native kernels are bound only when their libraries load"
    x = x.contiguous()
    hidden = x.shape[-1]
    w = None if weight is None else weight.contiguous()
    res = None if residual is None else residual.contiguous()
    out = torch.empty_like(x)
    args = (_ptr(x), _ptr(w), _ptr(res), out.data_ptr())

    split_rows("norms", lib.canvas_rms_norm, args, (hidden, eps), _norm_rows(x), _min_rows(hidden))
    return out


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`reference.add_rms_norm`, natively."""
    same = residual.shape == x.shape
    if not same or not _native_norm(residual, x, weight) or x.numel() == 0:
        return reference.add_rms_norm(residual, x, weight, eps)
    return _norm(x, weight, residual, eps)


def rms_norm_pair(
    x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm_pair`, natively."""
    if not _native_norm(x, weight_a, weight_b) or x.numel() == 0:
        return reference.rms_norm_pair(x, weight_a, weight_b, eps)
    lib = library("norms")
    assert lib is not None, "native kernels are bound only when their libraries load"
    x = x.contiguous()
    hidden = x.shape[-1]
    wa, wb = weight_a.contiguous(), weight_b.contiguous()
    out_a, out_b = torch.empty_like(x), torch.empty_like(x)
    args = (x.data_ptr(), wa.data_ptr(), wb.data_ptr(), out_a.data_ptr(), out_b.data_ptr())

    rows, fn = _norm_rows(x), lib.canvas_rms_norm_pair
    split_rows("norms", fn, args, (hidden, eps), rows, _min_rows(hidden))
    return out_a, out_b


def close_layer(
    dense: torch.Tensor,
    moe: torch.Tensor,
    residual: torch.Tensor,
    dense_weight: torch.Tensor,
    moe_weight: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`reference.close_layer`, natively (scale: one value, or one per row)."""
    rows = _norm_rows(dense)
    operands = (dense, moe, residual, dense_weight, moe_weight, weight, scale)
    shaped = dense.shape == moe.shape == residual.shape and scale.numel() in (1, rows)
    if not shaped or not _native_norm(*operands) or dense.numel() == 0:
        return reference.close_layer(dense, moe, residual, dense_weight, moe_weight, weight,
                                     scale, eps)  # fmt: skip
    lib = library("norms")
    assert lib is not None, "native kernels are bound only when their libraries load"
    tensors = [t.contiguous() for t in operands]
    hidden = dense.shape[-1]
    out = torch.empty_like(tensors[0])
    pointers = [t.data_ptr() for t in tensors]
    per_row = int(scale.numel() == rows and rows > 1)

    head = (*pointers, per_row, out.data_ptr())
    split_rows("norms", lib.canvas_close_layer, head, (hidden, eps), rows, _min_rows(hidden))
    return out
