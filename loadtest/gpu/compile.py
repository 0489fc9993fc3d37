"""Every Triton kernel of Canvas compiled for a GPU architecture on a machine without a GPU:
compiled, within the architecture's shared memory, and (bf16) without register spills.

    python -m loadtest.gpu.compile                      # the real-shape bf16 kernels, sm_90
    python -m loadtest.gpu.compile --set all --arch 90 80 --json out.json   # `make gpu-compile`
    python -m loadtest.gpu.compile --shard 1/2          # every other variant (two processes)

Triton's wheel bundles `ptxas` and `cuobjdump`, so it compiles for `GPUTarget("cuda", arch, 32)`
with no GPU, CUDA toolkit or driver. The kernels are compiled through the project's own
launchers (`kernels.triton_*`), so each compile is exactly the specialisation a launch would
JIT-compile (block sizes, constexprs, divisibility and ==1 specialisations of the arguments):
a stand-in driver names the target, and `JITFunction.run` compiles with `warmup=True`, never
launching. Pointer arguments need only a dtype and an aligned address, so CPU tensors from
`torch.empty` with the real per-token dimensions give the kernels of a real step; the big
weights are never touched. Registers, stack and spill-local bytes are read from each cubin
with the bundled `cuobjdump --dump-resource-usage`.

Checks per compiled kernel: it compiles; `metadata.shared` (dynamic shared memory, what a
launch requests) is at most the architecture's opt-in limit per block; bf16 kernels have no
stack and no local memory (spills). fp32 kernels multiply with FMA dots (`ieee` precision),
which spill at the tile sizes tuned for bf16: reported, not failed. What this cannot check:
the C launcher's build, `cuFuncSetAttribute` at load, numerics, anything on the host.

Relies on Triton internals (`JITFunction.run`, `driver.set_active`): checked on Triton 3.6 and
3.9. Run it in its own process: it must import the kernels with TRITON_INTERPRET unset, and it
replaces Triton's active driver.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from loadtest.gpu.compile_variants import SETS, Variant, variants

# Opt-in dynamic shared memory per block (CUDA C programming guide, compute capabilities).
SHARED_LIMITS = {90: 232_448, 80: 166_912}
MAX_REGISTERS = 255


@dataclass(frozen=True, slots=True)
class Compiled:
    variant: str
    kernel: str
    arch: int
    shared: int  # dynamic shared memory, bytes
    registers: int
    stack: int  # bytes per thread
    local: int
    num_warps: int
    seconds: float  # 0 when an earlier variant compiled the same specialisation
    error: str = ""


def problems(c: Compiled, spills_allowed: bool) -> list[str]:
    """What is wrong with one compile, in words; [] when nothing is."""
    where = f"{c.variant}: {c.kernel} on sm_{c.arch}"
    if c.error:
        return [f"{where} does not compile: {c.error}"]
    found = []
    if c.shared > SHARED_LIMITS[c.arch]:
        found.append(f"{where} needs {c.shared} B of shared memory (limit {SHARED_LIMITS[c.arch]})")
    if c.registers > MAX_REGISTERS:
        found.append(f"{where} uses {c.registers} registers")
    if not spills_allowed and (c.stack or c.local):
        found.append(f"{where} spills: {c.stack} B stack, {c.local} B local per thread")
    return found


def _triton_bin(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, SHARED (static) and LOCAL of the one function in `cubin`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_triton_bin("cuobjdump"), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    assert found is not None, f"cuobjdump printed no resource usage:\n{out}"
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, found.groups()), strict=True))


class _StandInDriver:
    """What `JITFunction.run` asks the driver before a launch; the device number is the
    architecture, so each architecture has its own in-memory kernel cache."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target, self.arch = GPUTarget("cuda", arch, 32), arch

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextmanager
def compile_only(arch: int, record: list[tuple[str, Any, float]]) -> Iterator[None]:
    """Within: Triton compiles for sm_`arch` and launches nothing; each kernel a launcher asks
    for is appended to `record` as (name, CompiledKernel, seconds)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    run = JITFunction.run
    previous = driver._active  # None until something asked; reset_active would make a CUDA one

    def compile_run(self: Any, *args: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        record.append((self.fn.__name__, None, 0.0))  # named even if it does not compile
        start = time.perf_counter()
        kernel = run(self, *args, grid=grid, warmup=True, **kw)
        record[-1] = (self.fn.__name__, kernel, time.perf_counter() - start)
        return kernel

    driver.set_active(_StandInDriver(arch))
    JITFunction.run = compile_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        JITFunction.run = run  # type: ignore[method-assign]
        driver._active = previous


def compile_variant(variant: Variant, arch: int) -> list[Compiled]:
    """Compile every kernel of one launcher call for sm_`arch`."""
    record: list[tuple[str, Any, float]] = []
    try:
        with compile_only(arch, record):
            variant.launch()
    except Exception as exc:  # a kernel that does not compile (or a launcher that refused)
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
        name = record[-1][0] if record else "(no kernel)"
        return [Compiled(variant.name, name, arch, 0, 0, 0, 0, 0, 0.0, last)]
    out = []
    for name, kernel, seconds in record:
        usage, meta = resource_usage(kernel.asm["cubin"]), kernel.metadata
        regs, stack, local = usage["REG"], usage["STACK"], usage["LOCAL"]
        shared, warps = meta.shared, meta.num_warps
        out.append(Compiled(variant.name, name, arch, shared, regs, stack, local, warps, seconds))
    assert out, f"{variant.name} compiled no kernel"
    return out


def check(variants: list[Variant], archs: list[int]) -> tuple[list[Compiled], list[str]]:
    """Compile every variant for every architecture from its `min_arch`: (the compiles, what is
    wrong)."""
    compiled, found = [], []
    for arch in archs:
        for v in (v for v in variants if arch >= v.min_arch):
            for c in compile_variant(v, arch):
                compiled.append(c)
                found += problems(c, v.spills_allowed)
    return compiled, found


def table(compiled: list[Compiled]) -> str:
    head = "| variant | kernel | sm | warps | shared B | regs | stack B | local B | compile s |"
    rows = [head, "|" + "---|" * 9]
    for c in compiled:
        rows.append(
            f"| {c.variant} | {c.kernel} | {c.arch} | {c.num_warps} | {c.shared:,} | "
            f"{c.registers} | {c.stack:,} | {c.local:,} | {c.seconds:.1f} |"
            if not c.error
            else f"| {c.variant} | {c.kernel} | {c.arch} | – | – | – | – | – | FAILED |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.gpu.compile", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--set", choices=sorted(SETS), default="make-test", dest="which")
    p.add_argument("--arch", type=int, nargs="+", choices=sorted(SHARED_LIMITS), default=[90])
    p.add_argument("--json", type=Path, help="write the compiles and problems here")
    p.add_argument(
        "--shard",
        default="0/1",
        help="I/N: compile only every N-th variant from the I-th (N processes run in parallel)",
    )
    args = p.parse_args(argv)
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        p.error(f"--shard takes I/N with 0 <= I < N, got {args.shard!r}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the kernels must be defined for compilation")
    import triton

    compiled, found = check(variants(args.which)[int(index) :: int(count)], args.arch)
    print(
        f"Triton {triton.__version__}, set {args.which!r}, sm_{', sm_'.join(map(str, args.arch))}"
    )
    print(table(compiled))
    if args.json:
        report = {"triton": triton.__version__, "compiled": [asdict(c) for c in compiled]}
        args.json.write_text(json.dumps(report | {"problems": found}, indent=2) + "\n")
    for line in found:
        print("PROBLEM:", line)
    print(f"{len(compiled)} compiles, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
