"""The overlap bench's comparison of each mode with serial steps (`loadtest.cpu.overlap_bench`):
the hidden shares and their summary over rounds, on made-up runs; and `make bench`'s share of
the serial loop's engine overhead that `--overlap` hides (`loadtest.cpu.bench_report`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loadtest.cpu.bench_report import assemble
from loadtest.cpu.bench_runs import Series
from loadtest.cpu.overlap_bench import Run, compare, summarize
from loadtest.load.loadgen import LevelResult
from loadtest.load.stats import EngineOverhead, RequestRecord
from loadtest.load.stats import summarize as summarize_run


def steps(cycle_ms: float, busy_ms: float) -> Run:
    """A run of 5 steps of 16 denoising canvases `cycle_ms` apart, each busy `busy_ms`."""
    stats = SimpleNamespace(
        row_kinds={"denoise": 16},
        forward_seconds=busy_ms / 1e3,
        sample_seconds=0.0,
        step_seconds=cycle_ms / 1e3,
    )
    return Run(seconds=1.0, tokens=100, steps=[(i * cycle_ms / 1e3, stats) for i in range(5)])


def test_the_bench_compares_each_mode_with_serial() -> None:
    """serial overhead 1 ms; the process mode's cycle 0.5 ms shorter (half hidden by cycles)
    with 0.25 ms of overhead left per step (three quarters hidden within steps)."""
    runs = {"serial": steps(11.0, 10.0), "process": steps(10.5, 10.25)}
    entry = compare(runs)
    hidden = {"cycles": 0.5, "overheads": 0.75, "waves": 0.75}  # 5 steps of 1 and 0.25 ms
    assert entry["process"]["hidden"] == pytest.approx(hidden)
    assert entry["serial"]["split"]["wave_overhead_ms"] == pytest.approx(5.0)
    assert entry["process"]["speedup"] == 1.0 and "hidden" not in entry["serial"]
    summary = summarize([{"c=16": entry}] * 2, [16], ("serial", "process"))["c=16"]
    assert summary["process_hidden_by_overheads"] == pytest.approx([0.75] * 3)
    assert summary["serial_overhead_ms"] == pytest.approx([1.0] * 3)


def server_run(step_ms: float, busy_ms: float) -> LevelResult:
    """A run of 10 steps as the server's step histograms give it, and 64 tokens in a second."""
    record = RequestRecord(0, "p", 0.0, 1.0, 0.5, (0.5,), 8, 64, "length", (8, 8), 16, 4.0)
    steps = EngineOverhead(10, step_ms / 100, busy_ms / 100)
    summary = summarize_run("x", "x", [record], 1.0, 16, engine_overhead=steps)
    return LevelResult(summary, (record,))


def test_make_bench_reports_the_share_of_the_overhead_that_overlap_hides() -> None:
    """Serial: 1 ms per step outside the forward and sampler; overlapped: 0.4 ms, then 0.6 ms:
    60% and 40% hidden, median 50% (the goal's bar); a serial round without steps gives none."""
    runs = {
        "canvas c=16": [server_run(11.0, 10.0), server_run(12.0, 11.0), server_run(0.0, 0.0)],
        "canvas-overlap c=16": [server_run(10.4, 10.0), server_run(10.6, 10.0)] * 2,
    }
    series = [
        Series(label, label.split()[0], "diffusion", 16, tuple(r[:3]), "float32")
        for label, r in runs.items()
    ]
    result = assemble({"denoising_steps": 8, "static_batch": 16}, series, [])
    ratios = {r["name"]: r for r in result["ratios"]}
    hidden = ratios["canvas-overlap c=16 overhead hidden"]
    assert hidden["per_round"][:2] == pytest.approx([0.6, 0.4]) and hidden["per_round"][2] is None
    assert hidden["median"] == pytest.approx(0.5)
    goals = {g["ratio"]: g for g in result["goals"]}
    assert goals["canvas-overlap c=16 overhead hidden"]["met"] is True
