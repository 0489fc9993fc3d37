"""The overlap bench's comparison of each mode with serial steps (`loadtest.cpu.overlap_bench`):
the hidden shares and their summary over rounds, on made-up runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loadtest.cpu.overlap_bench import Run, compare, summarize


def steps(cycle_ms: float, busy_ms: float) -> Run:
    """A run of 5 steps of 16 denoising canvases `cycle_ms` apart, each busy `busy_ms`."""
    stats = SimpleNamespace(
        row_kinds={"denoise": 16}, forward_seconds=busy_ms / 1e3, sample_seconds=0.0
    )
    return Run(seconds=1.0, tokens=100, steps=[(i * cycle_ms / 1e3, stats) for i in range(5)])


def test_the_bench_compares_each_mode_with_serial() -> None:
    """serial overhead 1 ms; the process mode's cycle 0.5 ms shorter (half hidden by cycles)
    with 0.25 ms of overhead left per step (three quarters hidden within steps)."""
    runs = {"serial": steps(11.0, 10.0), "process": steps(10.5, 10.25)}
    entry = compare(runs)
    assert entry["process"]["hidden"] == pytest.approx({"cycles": 0.5, "overheads": 0.75})
    assert entry["process"]["speedup"] == 1.0 and "hidden" not in entry["serial"]
    summary = summarize([{"c=16": entry}] * 2, [16], ("serial", "process"))["c=16"]
    assert summary["process_hidden_by_overheads"] == pytest.approx([0.75] * 3)
    assert summary["serial_overhead_ms"] == pytest.approx([1.0] * 3)
