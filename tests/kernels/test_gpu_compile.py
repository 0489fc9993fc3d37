"""Every real-shape bf16 Triton kernel compiles for sm_90 on this CPU-only machine (Triton's
bundled ptxas), within sm_90's shared memory and without register spills; and the check
catches a kernel that does not compile, one that needs too much shared memory and one that
spills (`loadtest.gpu.compile`; `make gpu-compile` runs the full matrix: every variant,
sm_80 too, and the GPU image's Triton).

Compiles run in a subprocess: the kernels must be defined with TRITON_INTERPRET unset (this
session interprets them), and the check replaces Triton's active driver. They use Triton's
on-disk cache like any JIT compile; a cold cache costs about 20 s of CPU here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.backends import TRITON_MODULES

pytest.importorskip("triton")
from loadtest.gpu.compile import SHARED_LIMITS, Compiled, check, problems  # noqa: E402
from loadtest.gpu.compile_variants import Variant, variants  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REAL_KERNELS = {
    "_canvas_attention_kernel",
    "_write_kv_kernel",
    "_router_kernel",
    "_expert_gemm_kernel",
    "_chunk_counts_kernel",
    "_expert_offsets_kernel",
    "_place_pairs_kernel",
    "_slot_sum_kernel",
    "_sample_kernel",
    "_probs_kernel",
    "_accept_kernel",
    "_philox_kernel",
    "_quantize_rows_kernel",
    "_norm_fp8_kernel",
    "_gated_act_fp8_kernel",
    "_fp8_expert_gemm_kernel",
    "_rms_norm_kernel",
    "_qkv_norm_rope_kernel",
    "_softcap_kernel",
    "_norm_tail_kernel",
    "_gated_act_kernel",
}


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return run_modules([(module, *args)])[0]


def run_modules(commands: list[tuple[str, ...]]) -> list[subprocess.CompletedProcess]:
    """`python -m module args` for each command, all at once (the compiles take one core each)."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-m", *command],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command in commands
    ]
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


def test_the_compiled_set_covers_every_triton_kernel_of_the_project() -> None:
    defined = {
        name
        for module in TRITON_MODULES
        for name in vars(importlib.import_module(module))
        if name.endswith("_kernel")
    }
    assert defined == REAL_KERNELS


def test_real_shape_bf16_kernels_compile_for_sm90_in_its_shared_memory_without_spills(
    tmp_path: Path,
) -> None:
    shards = [("loadtest.gpu.compile", "--json", str(tmp_path / f"sm90-{i}.json"), "--shard",
               f"{i}/2") for i in range(2)]  # fmt: skip
    for result in run_modules(shards):
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"sm90-{i}.json").read_text()) for i in range(2)]
    compiled = [c for report in reports for c in report["compiled"]]
    assert all(report["compiled"] for report in reports)  # each shard compiled its half
    assert {c["kernel"] for c in compiled} == REAL_KERNELS
    assert [p for report in reports for p in report["problems"]] == []
    for c in compiled:
        assert c["arch"] == 90 and not c["error"], c
        assert c["shared"] <= SHARED_LIMITS[90] and c["registers"] <= 255, c
        assert c["stack"] == 0 and c["local"] == 0, c
    # The largest: full attention at head_dim 512 (two 32-row tiles of 512, 3 stages).
    attention = [c for c in compiled if c["variant"] == "attention full D=512"]
    assert [c["shared"] for c in attention] == [165_888]


def test_the_check_catches_a_kernel_that_does_not_compile_is_too_large_or_spills() -> None:
    """Deliberately bad kernels (tests/kernels/bad_kernels.py), compiled for sm_90."""
    result = run_module("tests.kernels.bad_kernels")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = [
        json.loads(line)["problem"] for line in result.stdout.splitlines() if "problem" in line
    ]
    assert len(found) == 3, found
    retyped, shared, spills = found
    assert "retyped accumulator: _retyped_accumulator_kernel on sm_90 does not compile" in retyped
    assert "Loop-carried variable acc" in retyped
    assert "tiles too large for shared memory: _tile_kernel on sm_90 needs" in shared
    assert "(limit 232448)" in shared
    assert "accumulator too large for registers: _tile_kernel on sm_90 spills" in spills


def test_the_interpreter_runs_the_kernel_the_compiler_rejects() -> None:
    from kernels import interpreting
    from tests.kernels.bad_kernels import retyped_accumulator

    if not interpreting():
        pytest.skip("the interpreter runs only without a GPU")
    assert retyped_accumulator().tolist()[:2] == [0 + 16 + 32, 1 + 17 + 33]


def compiled(arch: int = 90, shared: int = 0, stack: int = 0, error: str = "") -> Compiled:
    return Compiled("v", "_k", arch, shared, 128, stack, 0, 4, 1.0, error)


def test_problems_name_the_limit_and_allow_spills_only_where_told() -> None:
    assert problems(compiled(shared=SHARED_LIMITS[90]), False) == []
    assert problems(compiled(shared=SHARED_LIMITS[90] + 1), False) == [
        "v: _k on sm_90 needs 232449 B of shared memory (limit 232448)"
    ]
    assert problems(compiled(arch=80, shared=200_000), False) == [
        "v: _k on sm_80 needs 200000 B of shared memory (limit 166912)"
    ]
    assert problems(compiled(stack=64), True) == []
    assert problems(compiled(stack=64), False) == [
        "v: _k on sm_90 spills: 64 B stack, 0 B local per thread"
    ]
    assert problems(compiled(error="boom"), True) == ["v: _k on sm_90 does not compile: boom"]


def test_fp8_variants_compile_from_sm89_only_and_sit_in_the_real_set() -> None:
    """Triton has no E4M3 before sm_89 (sm_80 engines bind the dequantizing twins): the check
    skips an FP8 variant there instead of reporting it, and launches it from sm_89 on."""
    launched: list[int] = []
    fp8 = Variant("toy FP8", "real", lambda: launched.append(1), min_arch=89)
    assert check([fp8], [80]) == ([], []) and launched == []
    names = {v.name for v in variants("make-test") if v.min_arch == 89}
    assert {"FP8 experts", "FP8 quantize rows hidden"} <= names
    assert {v.name for v in variants("fp8")} >= names
