"""The benchmark harness end to end at toy size (the c16 preset, concurrency 1 and 2, two
requests, two denoising steps): it produces every field of its JSON and markdown reports.
Nothing here asserts on timing; only on structure and on the fixed step count."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine.testing import (
    PRESETS,
    REAL_26B_A4B_TEXT_CONFIG,
    estimate_parameters,
    preset_text_config,
)
from loadtest.bench import main
from loadtest.metrics import parse_step_totals
from loadtest.prompts import PROMPT_SETS, make_prompts

SUMMARY_FIELDS = {
    "label", "system", "concurrency", "request_rate", "num_requests", "num_errors",
    "duration_s", "requests_per_s", "output_tokens", "output_tokens_per_s", "ttft_s",
    "latency_s", "canvas_s", "tpot_s", "steps_per_canvas", "tokens_per_forward",
    "error_examples", "engine_overhead", "records",
}  # fmt: skip
RECORD_FIELDS = {
    "index", "prompt_name", "start", "latency", "ttft", "canvas_seconds", "prompt_tokens",
    "output_tokens", "finish_reason", "steps_per_canvas", "decoder_passes",
    "tokens_per_forward", "error",
}  # fmt: skip
META_FIELDS = {
    "command", "preset", "checkpoint", "checkpoint_description", "parameters",
    "canvas_length", "max_tokens", "denoising_steps", "adaptive_stop", "note", "prompt_set",
    "num_prompts", "concurrency", "ar_concurrency", "exact_concurrency", "floor",
    "requests_per_level", "ar_requests_per_level",
    "reference_requests", "static_batch", "static_batch_requests", "warmup", "seed",
    "torch_threads", "torch_version", "transformers_version", "hardware", "config", "seconds",
}  # fmt: skip
BY_CONCURRENCY_FIELDS = {
    "numerics", "concurrency", "output_tokens_per_s", "fraction_of_floor", "fast_vs_exact",
    "throughput_vs_reference_one_at_a_time",
    "throughput_vs_reference_static_batch", "latency_p50_s", "engine_overhead_fraction",
    "mean_step_ms", "num_steps",
}  # fmt: skip
LABELS = (
    "canvas c=1",
    "canvas c=2",
    "canvas-ar c=2",
    "canvas-exact c=1",
    "canvas-exact c=2",
    "reference 1-at-a-time",
    "reference static batch 2",
)


@pytest.fixture(scope="module")
def toy_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bench")
    out = root / "out"
    argv = ["--size", "toy", "--out", str(out), "--cache-dir", str(root / "cache")]
    assert main(argv) == 0
    return out, json.loads((out / "results.json").read_text())


def test_bench_json_has_every_section_and_run(toy_bench):
    _, result = toy_bench
    assert set(result) == {"meta", "runs", "comparison", "goals", "checks"}
    assert set(result["meta"]) == META_FIELDS
    assert result["meta"]["adaptive_stop"] is False
    assert "fixed step count" in result["meta"]["note"]
    assert [run["label"] for run in result["runs"]] == list(LABELS)
    for run in result["runs"]:
        assert set(run) == SUMMARY_FIELDS
        assert run["num_errors"] == 0 and run["num_requests"] == 2
        assert run["output_tokens"] == 2 * 24  # EOS ignored: every request gets its budget
        assert {"count", "mean", "p50", "p90", "p99"} == set(run["latency_s"])
        assert all(set(record) == RECORD_FIELDS for record in run["records"])


def test_bench_reports_engine_overhead_for_canvas_runs_only(toy_bench):
    _, result = toy_bench
    overhead = {run["label"]: run["engine_overhead"] for run in result["runs"]}
    for label in ("canvas c=1", "canvas c=2", "canvas-ar c=2", "canvas-exact c=2"):
        assert set(overhead[label]) == {
            "num_steps", "step_seconds", "forward_seconds", "sample_seconds", "mean_step_ms",
            "overhead_fraction",
        }  # fmt: skip
        assert overhead[label]["sample_seconds"] > 0
        assert overhead[label]["num_steps"] > 0
        assert 0.0 <= overhead[label]["overhead_fraction"] <= 1.0
    assert overhead["reference 1-at-a-time"] is None


def test_bench_comparison_and_goals_cover_every_concurrency(toy_bench):
    _, result = toy_bench
    comparison = result["comparison"]
    rows = [(row["numerics"], row["concurrency"]) for row in comparison["by_concurrency"]]
    assert rows == [("fast", 1), ("fast", 2), ("exact", 1), ("exact", 2)]
    for row in comparison["by_concurrency"]:
        assert set(row) == BY_CONCURRENCY_FIELDS
        fast = row["numerics"] == "fast"  # fast rows carry their ratio over the exact ones
        assert all(v is not None for k, v in row.items() if fast or k != "fast_vs_exact")
        assert row["fraction_of_floor"] > 0
    assert result["meta"]["floor"]["gemm_gflop_per_s"] > 0
    assert all(value is not None for value in comparison["latency_at_1"].values())
    assert [row["concurrency"] for row in comparison["ar_mode"]] == [2]
    assert len(result["goals"]) == 6
    for goal in result["goals"]:
        assert set(goal) == {"goal", "quantity", "op", "target", "value", "met"}
        assert goal["value"] is not None and goal["met"] in (True, False)


def test_every_canvas_runs_the_fixed_step_count_in_canvas_and_reference(toy_bench):
    _, result = toy_bench
    assert result["checks"] == {
        "canvas_fixed_steps": True,
        "reference_fixed_steps": True,
        "num_errors": 0,
    }
    diffusion = [run for run in result["runs"] if run["system"] != "canvas-ar"]
    for run in diffusion:
        for record in run["records"]:
            assert record["steps_per_canvas"] == [2, 2]  # 24 tokens = two 16-token canvases
            assert record["decoder_passes"] == 4


def test_bench_markdown_has_every_section_and_run(toy_bench):
    out, _ = toy_bench
    report = (out / "results.md").read_text()
    for heading in (
        "## Runs",
        "## Canvas vs the reference",
        "## Canvas AR mode (same checkpoint)",
        "## Goals (notes, not asserts)",
        "Random weights",
        "Latency at 1 request",
        "Checks: every Canvas canvas ran 2 steps: True",
        "| numerics | concurrency | Canvas out tok/s | of FLOP floor |",
        "fast vs exact",
        "FLOP floor:",
    ):
        assert heading in report
    for label in LABELS:
        assert f"| {label} |" in report
    for column in ("out tok/s", "TTFT p50 (s)", "latency p99 (s)", "canvas p50 (ms)", "TPF"):
        assert column in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "throughput.png").stat().st_size > 0
        assert (out / "latency_cdf.png").stat().st_size > 0


def test_real_26b_config_has_the_published_parameter_counts():
    count = estimate_parameters(REAL_26B_A4B_TEXT_CONFIG)
    assert 25.2e9 <= count.total < 25.3e9  # DESIGN.md: 25.2B total, 3.8B active
    assert 3.8e9 <= count.active < 3.9e9


def test_bench_small_scales_down_the_real_layer_pattern_and_moe():
    from transformers import DiffusionGemmaConfig

    text = preset_text_config("bench-small")
    config = DiffusionGemmaConfig(
        text_config=text, canvas_length=PRESETS["bench-small"].canvas_length
    )
    assert config.text_config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert text["attention_k_eq_v"] and text["num_experts"] > text["top_k_experts"] >= 2
    assert 10e6 < estimate_parameters(text).total < 100e6


def test_prompt_sets_are_deterministic():
    for name in PROMPT_SETS:
        assert make_prompts(name, 5, seed=3) == make_prompts(name, 5, seed=3)
        assert make_prompts(name, 5, seed=3) != make_prompts(name, 5, seed=4)


def test_step_totals_sum_the_canvas_step_histograms():
    text = (
        "# HELP canvas:step_seconds Engine step wall time\n"
        'canvas:step_seconds_count{model_name="m"} 10.0\n'
        'canvas:step_seconds_sum{model_name="m"} 2.0\n'
        'canvas:forward_seconds_sum{model_name="m"} 1.5\n'
    )
    totals = parse_step_totals(text)
    assert totals is not None and totals.num_steps == 10 and totals.forward_seconds == 1.5
    assert parse_step_totals("vllm:num_requests_running 0\n") is None
