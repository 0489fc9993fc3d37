"""Compiling and loading the native libraries: each `kernels/native/<name>.c` (with the headers
beside it) compiled at first use with the system compiler and loaded through ctypes.

Build: `cc -O3 -march=native -shared -fopenmp` (the compiler from $CC, else `cc`; without
-fopenmp where that fails) into $CANVAS_CACHE/native (default ~/.cache/canvas/native), named by
a hash of the source, its headers, the flags and the machine, once per machine; a build that
fails, or a machine without a compiler, leaves the twins bound (one warning), and
`CANVAS_NATIVE=0` turns the libraries off. Every kernel takes a pointer to its argument struct
(`kernels.native.args.SIGNATURES`)."""

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
from pathlib import Path

from kernels.native.args import I64, SIGNATURES

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("sampler.c")
# No -ffast-math or -fassociative-math: the kernel's vector code fixes the order of every sum
# (a row's bits never depend on its address, so never on its batch) and its NaN checks stay.
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu99", "-fno-math-errno")
# Functions returning an int64 (the rest return nothing).
RETURNS_I64 = {
    "canvas_moe_lanes",
    "canvas_moe_sort",
    "canvas_attention_lanes",
    "canvas_step_lanes",
    "canvas_bf16_paths",
    *(f"canvas_{name}_openmp" for name in SIGNATURES),
}


def enabled() -> bool:
    return os.environ.get("CANVAS_NATIVE", "1") not in ("0", "false", "False", "")


def cache_dir() -> Path:
    root = Path(os.environ.get("CANVAS_CACHE", Path.home() / ".cache" / "canvas"))
    return root / "native"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def build(source: Path = SOURCE, out_dir: Path | None = None, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of `source` (compiled with FLAGS and `extra`), compiled unless this
    machine already has it. Raises RuntimeError when no compiler is found or the build fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')!r} not found)")
    # the source and the headers it may include (parallel.h)
    code = b"".join(p.read_bytes() for p in (source, *sorted(source.parent.glob("*.h"))))
    key = hashlib.sha256(
        b"\0".join([code, " ".join((*FLAGS, *extra)).encode(), cc.encode(), machine().encode()])
    ).hexdigest()[:16]
    directory = out_dir or cache_dir()
    library = directory / f"{source.stem}-{key}.so"
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name, then renamed: a concurrent build never loads half a file.
    fd, staging = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        command = [cc, *FLAGS, *extra, str(source), "-o", staging, "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(staging, library)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return library


def machine() -> str:
    """What `-march=native` compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return platform.machine() + "\n" + "\n".join(lines)
    except OSError:
        return platform.machine() + platform.processor()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo's `flags`: avx512_bf16, amx_bf16, ...); empty
    where unreadable."""
    line = next((ln for ln in machine().splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def library(name: str = "sampler") -> ctypes.CDLL | None:
    """The loaded library `native/<name>.c`, or None (the twins stay bound) when disabled or
    unbuildable."""
    if not enabled():
        return None
    try:
        lib = ctypes.CDLL(str(build_with_openmp(name)))
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        logger.warning(
            "native CPU kernels (%s) unavailable, using the PyTorch twins: %s", name, exc
        )
        return None
    for function in RETURNS_I64:  # the no-argument ones (SIGNATURES' below keep theirs)
        if hasattr(lib, function):
            getattr(lib, function).argtypes, getattr(lib, function).restype = [], I64
    for function, struct in SIGNATURES[name].items():
        fn = getattr(lib, function)
        fn.argtypes = [ctypes.POINTER(struct)]
        fn.restype = I64 if function in RETURNS_I64 else None
    return lib


def loaded(name: str) -> ctypes.CDLL:
    """`library(name)`, which the native kernels are bound only where it loads."""
    lib = library(name)
    assert lib is not None, "native kernels are bound only when their libraries load"
    return lib


def build_with_openmp(name: str) -> Path:
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
