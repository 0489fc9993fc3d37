"""The first-GPU-run script on CPU (`--dry-run`: toy shapes, fp32, the twins): every stage runs
its plumbing and writes its file and the summary as it ends; a stage that fails or runs past
its budget is recorded, and the next stage runs anyway."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.gpu import first_run


@pytest.fixture
def quick_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check stage runs a trivial command (`loadtest.gpu.check`'s dry run has its own
    test in test_gpu_bench.py and takes most of a minute)."""
    command = [sys.executable, "-c", "import sys; print('checked', sys.argv[1:])"]
    monkeypatch.setattr(first_run, "CHECK_COMMAND", command)


def _stage_files(out: Path) -> dict[str, dict[str, object]]:
    return {
        p.stem.split("_", 1)[1]: json.loads(p.read_text())
        for p in sorted(out.glob("[0-9]*_*.json"))
    }


def test_the_dry_run_runs_every_stage_and_writes_each_ones_file(tmp_path: Path, quick_check):
    assert first_run.main(["--dry-run", "--out", str(tmp_path)]) == 0
    files = _stage_files(tmp_path)
    assert list(files) == list(first_run.STAGES)
    assert all(f["ok"] for f in files.values()), {k: f.get("error") for k, f in files.items()}
    results = {name: f["result"] for name, f in files.items()}
    assert results["parity"]["kernels"]["canvas_attention"]["calls"] > 0  # type: ignore[index]
    assert results["parity"]["over_tolerance"] == []  # type: ignore[index]
    assert "fused_moe" in results["launch"]["host_us_per_call"]  # type: ignore[operator]
    prefixes = {t["prefix"] for t in results["attention"]["timings"]}  # type: ignore[index]
    assert prefixes == {16, 32, 64}
    assert results["load"]["bytes"] > 0 and results["check"]["rc"] == 0  # type: ignore[index]
    for canvases in (1, 16):
        trace = json.loads((tmp_path / f"trace_r{canvases}.json").read_text())
        assert trace["traceEvents"]
    summary = (tmp_path / "first_run.md").read_text()
    assert all(f"- {name}:" in summary for name in first_run.STAGES), summary


def test_a_failing_or_overlong_stage_is_recorded_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def broken(run: first_run.Run) -> dict[str, object]:
        raise RuntimeError("CUDA error: no kernel image is available")

    def slow(run: first_run.Run) -> dict[str, object]:
        time.sleep(30)
        return {}

    monkeypatch.setitem(first_run.STAGES, "env", broken)
    monkeypatch.setitem(first_run.STAGES, "load", slow)
    monkeypatch.setitem(first_run.BUDGETS, "load", 0.02)  # x10 in a dry run
    args = ["--dry-run", "--out", str(tmp_path), "--stages", "env,load,pageable"]
    started = time.monotonic()
    assert first_run.main(args) == 1
    assert time.monotonic() - started < 10
    files = _stage_files(tmp_path)
    assert set(files) == {"env", "load", "pageable"}
    assert not files["env"]["ok"] and "no kernel image" in str(files["env"]["error"])
    assert not files["load"]["ok"] and "StageTimeout" in str(files["load"]["error"])
    assert files["pageable"]["ok"]


def test_unknown_stages_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert first_run.main(["--dry-run", "--out", str(tmp_path), "--stages", "env,warp"]) == 2
    assert "--stages: unknown ['warp']" in capsys.readouterr().err


def test_a_kernel_that_disagrees_with_its_twin_fails_the_parity_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    twins = first_run.resolve_kernels("cpu", "twins")

    def off_by_one(*args: object, **kwargs: object) -> object:
        return twins.softcap(*args, **kwargs) + 1  # type: ignore[operator]

    monkeypatch.setattr(first_run, "resolve_kernels", lambda *a: replace(twins, softcap=off_by_one))
    args = ["--dry-run", "--out", str(tmp_path), "--stages", "parity"]
    assert first_run.main(args) == 1
    record = _stage_files(tmp_path)["parity"]
    assert not record["ok"] and "softcap: off its twin" in str(record["errors"])
    parity = record["result"]
    assert parity["over_tolerance"] == ["softcap"]  # type: ignore[index]
    assert parity["kernels"]["softcap"]["max_rel_error"] > 0.3  # type: ignore[index]
