"""Steady serving compiles no new Triton kernel: a launch's specialisation (Triton's cache key)
must not depend on the step's size. Triton specialises every integer argument on `== 1` and on
divisibility by 16 unless it is listed in `do_not_specialize`, so each integer that varies per
step (row, token, pair and element counts, the page table's width) is listed there, and the
block sizes are fixed (`rows_per_program`), not chosen from the step's token count.

`loadtest.gpu.specialisations` checks the same from the other side, without a GPU: each launcher
of a serving step at the real shapes asks Triton for the same kernels (cache keys) at 1, 37,
256 and 1,024 tokens.

The census is default-deny: an integer argument of a kernel is either in its
`do_not_specialize` or named below as fixed for an engine (a model dimension, a layer's window,
a stride of a weight, a pool or a per-model layout), so a new per-step argument fails here
until it is declared."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.backends import TRITON_MODULES

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

# Fixed for an engine: the same value at every step, so specialising on it compiles nothing
# new (and its divisibility by 16 lets the compiler vectorise the loads it addresses).
ENGINE_CONSTANTS = {
    *("dim", "hidden", "vocab", "length", "num_experts", "num_q_heads", "num_kv_heads"),
    *("k_dim", "n_dim", "block_m", "window"),
    # per-model layouts: projections' outputs, weights, KV pools, cos/sin tables, sampler rows
    *("sq_n", "sq_h", "sk_n", "sk_h", "sv_n", "sv_h", "so_n", "so_h", "sc_n", "stride_x"),
    *("skp_p", "skp_h", "skp_s", "svp_p", "svp_h", "svp_s"),
    *("sh_n", "sp_e", "sw_n", "si_n", "sx_n", "sw_e", "sw_o", "sr_n", "sr_k", "ss_e", "ss_o"),
    *("stride_p", "stride_q", "stride_e", "stride_o"),
}
FLOATS = {"eps", "cap", "qk_scale", "inv_sqrt_hidden"}  # never specialised by Triton


def kernels() -> list[tuple[str, object]]:
    """Every launched kernel (`*_kernel`) of the Triton modules, by qualified name."""
    found = []
    for module in TRITON_MODULES:
        for name, value in vars(importlib.import_module(module)).items():
            if name.endswith("_kernel"):
                found.append((f"{module}.{name}", value))
    return found


def unspecialised(kernel: object, what: str = "do_not_specialize") -> list[str]:
    """The argument names a kernel's `do_not_specialize` (or `what`: its
    `do_not_specialize_on_alignment`) lists, compiled or interpreted."""
    names = getattr(kernel, what, None)
    if names is None:  # the interpreter's function keeps the decorator's arguments
        names = kernel.kwargs.get(what) or []  # type: ignore[attr-defined]
    return list(names)


def scalar_arguments(kernel: object) -> list[str]:
    """A kernel's arguments that are neither constexpr nor pointers."""
    params = inspect.signature(kernel.fn).parameters.values()  # type: ignore[attr-defined]
    return [
        p.name
        for p in params
        if "constexpr" not in str(p.annotation) and not p.name.endswith("_ptr")
    ]


def test_the_census_sees_every_kernel_of_the_project() -> None:
    names = {name.rsplit(".", 1)[1] for name, _ in kernels()}
    assert {"_rms_norm_kernel", "_canvas_attention_kernel", "_philox_kernel"} <= names
    assert len(names) >= 17


@pytest.mark.parametrize("name, kernel", kernels(), ids=[n for n, _ in kernels()])
def test_every_per_step_integer_is_left_unspecialised(name: str, kernel: object) -> None:
    scalars = scalar_arguments(kernel)
    listed = unspecialised(kernel)
    unknown = [n for n in listed if n not in scalars]
    assert not unknown, f"{name}: do_not_specialize names no such scalar argument: {unknown}"
    params = inspect.signature(kernel.fn).parameters  # type: ignore[attr-defined]
    unaligned = unspecialised(kernel, "do_not_specialize_on_alignment")
    unknown = [n for n in unaligned if n not in params or not n.endswith("_ptr")]
    assert not unknown, f"{name}: do_not_specialize_on_alignment names no pointer: {unknown}"
    undeclared = [n for n in scalars if n not in listed and n not in ENGINE_CONSTANTS | FLOATS]
    assert not undeclared, (
        f"{name}: {undeclared} would be specialised per value: add them to its "
        "do_not_specialize (they vary per step) or to ENGINE_CONSTANTS (fixed for an engine)"
    )


@pytest.mark.parametrize("name", ["num_rows", "num_tokens", "num_pairs", "numel", "st_r"])
def test_the_step_counts_are_never_declared_engine_constants(name: str) -> None:
    assert name not in ENGINE_CONSTANTS


def test_row_blocks_do_not_follow_the_step_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled (not interpreted), a norm's rows per program are one value for every row count:
    a step of 1, 7 or 4,096 rows launches the same kernel."""
    from kernels import triton_norm

    monkeypatch.setattr(triton_norm, "interpreting", lambda: False)
    for row_elements in (256, 512, 4096):
        blocks = {triton_norm.rows_per_program(row_elements, n) for n in (1, 2, 7, 16, 4096)}
        assert len(blocks) == 1, (row_elements, blocks)
    monkeypatch.setattr(triton_norm, "interpreting", lambda: True)
    assert triton_norm.rows_per_program(256, 3) == 4  # the interpreter pays per lane


def run_python(*args: str) -> subprocess.CompletedProcess:
    """`python ARGS` with the kernels defined for compilation (TRITON_INTERPRET unset)."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-W", "ignore", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# One process for both checks (importing torch and Triton is most of its time): the serving
# launchers' check, then a deliberately count-specialised kernel's (tests/kernels/bad_kernels).
CHECKS = """
from loadtest.gpu.specialisations import main, size_dependent
from tests.kernels.bad_kernels import counted
print("rc", main([]))
for line in size_dependent({"counted": lambda n: lambda: counted(n)}, (1, 37, 256)):
    print("BAD:", line)
"""


@pytest.fixture(scope="module")
def size_checks() -> list[str]:
    result = run_python("-c", CHECKS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()


def test_no_serving_launcher_asks_for_another_kernel_at_another_step_size(size_checks) -> None:
    """Every launcher of a step, real 26B-A4B shapes, bf16, sm_90: the same cache keys at an AR
    token, an odd prefill chunk, a canvas and four canvases (rows packed at other offsets, page
    tables of other widths); nothing is compiled (`loadtest.gpu.specialisations`)."""
    assert "18 call sites at 1, 37, 256, 1024 tokens: 0 size-dependent kernels" in size_checks
    assert "rc 0" in size_checks


def test_the_size_check_catches_a_kernel_specialised_on_its_count(size_checks) -> None:
    assert [line for line in size_checks if line.startswith("BAD:")] == [
        "BAD: counted: _counted_kernel at 37 tokens is not the kernel compiled at 1 "
        "(1 against 1 specialisations)",
        "BAD: counted: _counted_kernel at 256 tokens is not the kernel compiled at 1 "
        "(1 against 1 specialisations)",
    ]
