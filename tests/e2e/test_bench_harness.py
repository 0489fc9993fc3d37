"""The benchmark harness end to end at toy size (the c16 preset, concurrency 1 and 2, two
requests, two denoising steps): it produces every field of its JSON and markdown reports.
Nothing here asserts on timing; only on structure and on the fixed step count."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from engine.checkpoints.tiny import (
    PRESETS,
    REAL_26B_A4B_TEXT_CONFIG,
    estimate_parameters,
    preset_text_config,
)
from engine.cpu_threads import auto_choices, describe_threads
from loadtest.cpu.bench import BenchConfig, build_parser, configs_from_args, main
from loadtest.cpu.bench_report import thread_shares
from loadtest.load.metrics import StepTotals, parse_step_totals
from loadtest.load.prompts import PROMPT_SETS, make_prompts

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
    "num_prompts", "concurrency", "ar_concurrency", "exact_concurrency", "overlap_concurrency",
    "floor",
    "reference_requests", "static_batch", "warmup", "repeats", "seed",
    "torch_threads", "canvas_server", "canvas_server_threads", "torch_version",
    "transformers_version", "hardware", "config", "seconds",
}  # fmt: skip
LABELS = (  # per mode and width, each Canvas run next to the reference run it is compared with
    "canvas c=1",
    "canvas-exact c=1",
    "reference 1-at-a-time",
    "canvas c=2",
    "canvas-exact c=2",
    "reference static batch 2",
    "canvas-ar c=1",
    "reference-ar 1-at-a-time",
    "canvas-ar c=2",
    "reference-ar static batch 2",
)


@pytest.fixture(scope="module")
def toy_bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bench")
    argv = ["--size", "toy", "--out", str(root / "out"), "--cache-dir", str(root / "cache")]
    argv += ["--dtypes", "float32"]  # bf16 beside it: tests/unit/test_bench_dtypes.py
    assert main(argv) == 0
    out = root / "out" / "toy"
    return out, json.loads((out / "results.json").read_text())


def test_bench_json_has_every_section_and_configuration(toy_bench):
    _, result = toy_bench
    assert set(result) == {"meta", "series", "ratios", "goals", "checks", "ledger"}
    assert set(result["meta"]) == META_FIELDS
    assert result["meta"]["adaptive_stop"] is False
    assert "fixed step count" in result["meta"]["note"]
    assert [s["label"] for s in result["series"]] == list(LABELS)
    for series in result["series"]:
        assert len(series["runs"]) == result["meta"]["repeats"] == 2
        tput = series["output_tokens_per_s"]
        assert tput["min"] <= tput["median"] <= tput["max"] and len(tput["per_round"]) == 2
        for run in series["runs"]:
            assert set(run) == SUMMARY_FIELDS
            assert run["num_errors"] == 0 and run["num_requests"] == 2
            assert run["output_tokens"] == 2 * 24  # EOS ignored: every request gets its budget
            assert all(set(record) == RECORD_FIELDS for record in run["records"])


def test_every_timed_configuration_was_warmed_at_its_shape_first_and_timed_twice(toy_bench):
    _, result = toy_bench
    warmed: dict[str, dict] = {}
    timed: dict[str, list[int]] = {}
    for event in result["ledger"]:
        label, shape = event["label"], event["shape"]
        if event["kind"] == "warmup":
            assert label not in timed, f"{label} warmed after it was timed"
            warmed[label] = shape
        else:
            assert event["kind"] == "timed"
            assert warmed.get(label) == shape, f"{label} timed at a shape it was not warmed at"
            timed.setdefault(label, []).append(event["round"])
    assert set(timed) == set(LABELS) == {s["label"] for s in result["series"]}
    assert all(rounds == [1, 2] for rounds in timed.values())
    shapes = {label: (s["width"], s["denoising_steps"]) for label, s in warmed.items()}
    assert shapes["reference static batch 2"] == (2, 2) and shapes["canvas-ar c=1"] == (1, 0)
    # no configuration is timed until every one is warm: the first timed run follows the last
    kinds = [e["kind"] for e in result["ledger"]]
    assert kinds == ["warmup"] * len(LABELS) + ["timed"] * 2 * len(LABELS)


def test_bench_splits_every_step_into_forward_sampler_and_rest_on_both_sides(toy_bench):
    _, result = toy_bench
    for series in result["series"]:
        for run in series["runs"]:
            overhead = run["engine_overhead"]
            assert overhead["num_steps"] > 0, series["label"]
            assert 0 < overhead["forward_seconds"] <= overhead["step_seconds"]
            assert 0.0 <= overhead["overhead_fraction"] <= 1.0
            if series["mode"] == "diffusion":
                assert overhead["sample_seconds"] > 0, series["label"]
        step = series["step_ms"]
        assert set(step) == {"steps", "step_ms", "forward_ms", "sample_ms"}
        assert step["forward_ms"]["median"] <= step["step_ms"]["median"]


def test_ratios_are_taken_within_each_round(toy_bench):
    _, result = toy_bench
    ratios = {r["name"]: r for r in result["ratios"]}
    series = {s["label"]: s["output_tokens_per_s"]["per_round"] for s in result["series"]}
    for name, (top, bottom) in {
        "canvas c=2 / reference static batch 2": ("canvas c=2", "reference static batch 2"),
        "canvas c=1 / reference 1-at-a-time": ("canvas c=1", "reference 1-at-a-time"),
        "canvas c=2 / canvas-exact c=2": ("canvas c=2", "canvas-exact c=2"),
        "canvas-ar c=1 / reference-ar 1-at-a-time": ("canvas-ar c=1", "reference-ar 1-at-a-time"),
        "canvas-ar c=2 / reference-ar static batch 2": (
            "canvas-ar c=2",
            "reference-ar static batch 2",
        ),
        "canvas-ar c=2 / reference-ar 1-at-a-time": ("canvas-ar c=2", "reference-ar 1-at-a-time"),
    }.items():
        expected = [t / b for t, b in zip(series[top], series[bottom], strict=True)]
        assert ratios[name]["per_round"] == pytest.approx(expected)
        assert ratios[name]["min"] <= ratios[name]["median"] <= ratios[name]["max"]
    floor = result["meta"]["floor"]
    assert floor["gemm_gflop_per_s"] > 0 and floor["gflops_prompt_per_canvas"] > 0
    # the floor counts the prompts' prefill too (served without a prefix cache): a lower
    # throughput than the decode floor, so a larger fraction of it
    assert floor["floor_tokens_per_s"] < floor["decode_floor_tokens_per_s"]
    top = series["canvas c=2"]
    keys = {"floor": "floor_tokens_per_s", "decode floor": "decode_floor_tokens_per_s"}
    assert len(floor["gemm_gflop_per_s_per_round"]) == 2  # measured in each round
    for name, key in keys.items():
        expected = [t / f for t, f in zip(top, floor[f"{key}_per_round"], strict=True)]
        assert ratios[f"canvas c=2 / {name}"]["per_round"] == pytest.approx(expected)
    assert len(result["goals"]) == 8
    for goal in result["goals"]:
        assert set(goal) == {"ratio", "op", "target", "value", "met"}
        assert goal["ratio"] in ratios
        assert goal["value"] is not None and goal["met"] in (True, False)


def test_every_canvas_runs_the_fixed_step_count_in_canvas_and_reference(toy_bench):
    _, result = toy_bench
    assert result["checks"] == {
        "canvas_fixed_steps": True,
        "reference_fixed_steps": True,
        "num_errors": 0,
    }
    for series in result["series"]:
        for run in series["runs"]:
            for record in run["records"]:
                if series["mode"] == "ar":
                    assert record["steps_per_canvas"] == [] and record["tokens_per_forward"] == 1
                else:
                    assert record["steps_per_canvas"] == [2, 2]  # 24 tokens: two canvases of 16
                    assert record["decoder_passes"] == 4


def test_bench_markdown_has_every_section_and_configuration(toy_bench):
    out, _ = toy_bench
    report = (out / "results.md").read_text()
    for heading in (
        "## Runs (each warmed at its shape, then timed once per round)",
        "## Per step (medians over rounds)",
        "## Ratios (within each round, from neighbouring runs)",
        "## Goals (medians; notes, not asserts)",
        "Random weights",
        "1 warm-up and 2 timed runs per configuration",
        "Checks: every Canvas canvas ran 2 steps: True",
        "| configuration | steps | step (ms) | forward (ms) | sampler (ms) | rest (ms) | rest |",
        "| ratio | round 1 | round 2 | min | median | max |",
        "FLOP floor:",
    ):
        assert heading in report
    for label in LABELS:
        assert f"| {label} |" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "throughput.png").stat().st_size > 0
        assert (out / "latency_cdf.png").stat().st_size > 0


def test_make_bench_runs_both_checkpoints_with_repeats_and_warm_ups():
    (small, tiny) = configs_from_args(build_parser().parse_args([]))
    assert (small.preset, tiny.preset) == ("bench-small", "bench-tiny")
    assert (small.out_dir.name, tiny.out_dir.name) == ("small", "tiny")
    assert min(small.repeats, tiny.repeats) >= 2 and min(small.warmup, tiny.warmup) >= 1
    text = preset_text_config("bench-tiny")
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (256, 6, 512)
    assert (text["num_experts"], text["top_k_experts"]) == (16, 4)
    assert PRESETS["bench-tiny"].canvas_length == 32
    assert (tiny.max_tokens, tiny.denoising_steps, tiny.static_batch) == (64, 8, 16)
    with pytest.raises(ValueError, match="repeats must be >= 2"):
        configs_from_args(build_parser().parse_args(["--size", "toy", "--repeats", "1"]))


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
    # Steps per CPU thread count (--threads auto): the report's share of each, between scrapes.
    threads = '{model_name="m",threads="%d"} %.1f\n'
    before = parse_step_totals(text + "canvas:cpu_thread_steps_total" + threads % (1, 4))
    after = parse_step_totals(
        text
        + "canvas:cpu_thread_steps_total" + threads % (1, 10)
        + "canvas:cpu_thread_steps_total" + threads % (2, 2)
        + "canvas:cpu_thread_steps_created" + threads % (2, 1.7e9)
    )  # fmt: skip
    overhead = StepTotals.between(before, after)
    assert overhead is not None and overhead.thread_steps == {1: 6, 2: 2}
    runs = [{"engine_overhead": {"thread_steps": {"1": 6, "2": 2}}}, {"engine_overhead": None}]
    assert thread_shares(runs) == "1: 75%, 2: 25%" and thread_shares(runs[1:]) == "–"


def test_the_hybrid_benchmark_warms_then_reports_each_configuration(tiny_checkpoint, capsys):
    from loadtest.cpu import hybrid_bench

    args = ["--model", str(tiny_checkpoint("c16")), "--questions", "1", "--concurrency", "2"]
    assert hybrid_bench.main([*args, "--max-tokens", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or "| 2 |" in line]
    timed = [r for r in rows if r.count("|") == 10]  # per-round rows: round 0 is not printed
    assert len(timed) == 6  # 3 configurations at concurrency 1 and at 2
    assert all(r.split("|")[2].strip() == "1" for r in timed)  # only round 1 is reported
    assert {r.split("|")[3].strip() for r in timed} == set(hybrid_bench.CONFIGS)
    assert all(r.split("|")[-2].strip() in ("1/1", "2/2") for r in timed)  # greedy: AR's text


def test_a_sidecar_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    from loadtest.load.sidecar import serve_in_subprocess

    with (
        pytest.raises(RuntimeError, match="exited") as failure,
        serve_in_subprocess(tmp_path / "no-such-model", start_timeout_s=120),
    ):
        pass
    assert "no-such-model" in str(failure.value)


def test_the_bench_serves_canvas_from_its_own_process_unless_told(toy_bench):
    _, result = toy_bench
    assert result["meta"]["canvas_server"] == "subprocess"
    # The sidecars pick their own threads (auto: every core but one against all), not the
    # reference's.
    cores = len(os.sched_getaffinity(0))
    assert result["meta"]["canvas_server_threads"] == describe_threads(auto_choices(cores))
    assert BenchConfig(server="thread").server == "thread"
    for bad in ("0", "x", ""):
        with pytest.raises(ValueError, match="server_threads must be 'auto' or a count >= 1"):
            BenchConfig(server_threads=bad)
    with pytest.raises(ValueError, match="server must be"):
        BenchConfig(server="fork")
