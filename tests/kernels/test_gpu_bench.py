"""The GPU benchmark and the GPU check, on CPU: their help, their refusal without a GPU, the
real shapes they time, and a dry run of each whole flow (the engine's model at a toy shape,
every kernel, the engine step at 1 and 4 canvases, the reports; the gpu tests skip).

Dry runs go through a subprocess, as on the GPU machine: the benchmark picks Triton's
interpreter or the compiled kernels when triton is first imported, which this test session
has already done its own way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

from loadtest.gpu import bench as gpu_bench
from loadtest.gpu import check as gpu_check
from loadtest.gpu.kernel_timing import time_kernels
from loadtest.gpu.report import BenchReport

ROOT = Path(__file__).resolve().parents[2]
KERNELS = (
    "attention sliding",
    "attention full",
    "qkv_norm_rope sliding",
    "qkv_norm_rope full",
    "write_kv",
    "add_rms_norm",
    "rms_norm_pair",
    "close_layer",
    "gated_act",
    "route_experts",
    "fused_moe",
    "fused_sample",
    "entropy_accept",
    "soft_embedding",
)


def run_module(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    env.pop("TRITON_INTERPRET", None)  # the scripts choose for themselves
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("module", [gpu_bench, gpu_check])
def test_help_names_the_dry_run(module: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "--dry-run" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("module", [gpu_bench, gpu_check])
def test_without_a_gpu_it_points_to_the_dry_run(
    module: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert module.main([]) == 2
    assert "use --dry-run" in capsys.readouterr().err


def test_real_shapes_hold_the_26b_weights() -> None:
    config = gpu_bench.model_config()
    assert abs(gpu_bench.parameter_count(config) - 25.2e9) < 0.1e9
    shapes = gpu_bench.shape_summary(config)
    assert shapes["full_layers"] == [5, 11, 17, 23, 29]
    assert shapes["sliding_kv_heads_x_dim"] == [8, 256]
    assert shapes["full_kv_heads_x_dim"] == [2, 512]
    assert shapes["experts"] == [128, 8, 704] and shapes["vocab"] == 262_144
    assert shapes["canvas"] == 256


def test_dry_run_times_every_kernel_and_the_engine_step(tmp_path: Path) -> None:
    json_path, md_path = tmp_path / "bench.json", tmp_path / "bench.md"
    done = run_module(
        "loadtest.gpu.bench",
        "--dry-run",
        "--steps",
        "3",
        "--json",
        str(json_path),
        "--markdown",
        str(md_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for name in KERNELS:
        assert f"| {name} | 1 |" in out and f"| {name} | 4 |" in out, name
    report = json.loads(json_path.read_text())
    assert [e["canvases"] for e in report["engine"]] == [1, 4]
    # Three steps a canvas; the first may run in the prompt's forward (`first_step_along`).
    assert all(e["steps_per_canvas"] == [3] and e["timed_steps"] >= 1 for e in report["engine"])
    # stepped as the server steps, serially and with steps run ahead: both periods measured
    assert all(e["serial_period_ms"] > 0 and e["overlap_period_ms"] > 0 for e in report["engine"])
    assert report["checks_pass"] and not report["skipped"]
    assert {k["name"] for k in report["kernels"]} >= set(KERNELS)
    assert "## Engine step" in md_path.read_text()
    assert "step period ms, serial / --overlap" in md_path.read_text()
    last = out.strip().splitlines()[-4:]  # the summary comes last
    assert last[0].startswith("gpu_bench (dry run):") and "checks pass" in last[0]
    assert "1:" in last[1] and "4:" in last[1] and last[3].startswith("  reports:")


def test_gpu_check_dry_run_runs_the_gpu_tests_and_the_benchmark(tmp_path: Path) -> None:
    no_wheels = tmp_path / "no-wheels"
    no_wheels.mkdir()
    done = run_module(
        "loadtest.gpu.check",
        "--dry-run",
        "--out",
        str(tmp_path / "out"),
        "--wheels",
        str(no_wheels),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert names == {
        "gpu_check.json",
        "gpu_check.md",
        "gpu_tests.log",
        "gpu_tests.xml",
        "gpu_bench.json",
        "gpu_bench.md",
        "gpu_bench.log",
    }
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    tests = result["tests"]
    assert "tests/kernels/test_gpu_engine.py" in tests["files"]
    assert tests["rc"] == 0 and tests["failed"] == tests["errors"] == 0
    assert len(tests["cases"]) >= 8  # every gpu test was collected (and ran or skipped)
    if not torch.cuda.is_available():
        assert {c["outcome"] for c in tests["cases"]} == {"skipped"}
    assert result["bench"]["report"]["checks_pass"] and result["ok"]
    assert "# GPU check: ok (dry run)" in (tmp_path / "out" / "gpu_check.md").read_text()
    last = done.stdout.strip().splitlines()[-8:]  # the summary comes last
    assert last[-1].startswith("reports:")
    assert any(line.startswith("gpu_check (dry run): ok") for line in last)


def test_a_failing_kernel_is_recorded_and_the_others_still_timed() -> None:
    model = gpu_bench.build_model(
        gpu_bench.model_config(toy=True), torch.device("cpu"), torch.float32, "twins"
    )

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of resources: shared memory")

    model.bind_kernels(replace(model.kernels, fused_moe=boom))
    errors: list[str] = []
    timed = {t.name for t in time_kernels(model, 1, prefix=40, iters=1, errors=errors)}
    assert "fused_moe" not in timed and {"route_experts", "soft_embedding"} <= timed
    assert errors == ["fused_moe at 1 canvases: RuntimeError: out of resources: shared memory"]
    report = BenchReport(meta={"denoising_steps": 2}, errors=errors)
    assert not report.checks_pass()


def test_gpu_check_counts_and_names_failed_tests(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.kernels.test_moe" name="test_a[256]" time="1.5">'
        '<failure message="AssertionError: 0.97 &gt; 0.99">trace</failure></testcase>'
        '<testcase classname="tests.kernels.test_moe" name="test_b" time="0.2"/>'
        '<testcase classname="tests.kernels.test_sampler" name="test_c" time="0">'
        '<skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    result = gpu_check.parse_junit(xml)
    assert (result["passed"], result["failed"], result["errors"], result["skipped"]) == (1, 1, 0, 1)
    assert result["cases"][0] == {
        "name": "test_moe::test_a[256]",
        "outcome": "failed",
        "seconds": 1.5,
        "message": "AssertionError: 0.97 > 0.99",
    }
