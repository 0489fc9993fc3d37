"""The benchmark in two dtypes (`loadtest.cpu.bench_config`, `loadtest.cpu.bench_report`): every
configuration runs in fp32 and bf16 beside its twin, each against the reference in its own
dtype, and the report divides bf16 by fp32 within each round. Synthetic runs: no server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loadtest.cpu.bench import build_parser, configs_from_args, main
from loadtest.cpu.bench_config import BenchConfig, configurations
from loadtest.cpu.bench_report import assemble, bench_markdown
from loadtest.cpu.bench_runs import Series
from loadtest.load.loadgen import LevelResult
from loadtest.load.prompts import make_prompts
from loadtest.load.stats import RequestRecord, summarize

META = {
    "preset": "synthetic", "hardware": {"cpu": "cpu", "cpu_count": 2}, "torch_version": "x",
    "torch_threads": 2, "command": "test", "checkpoint_description": "none",
    "parameters": {"total": 1e6, "active": 1e6}, "canvas_length": 32, "max_tokens": 64,
    "prompt_set": "short-chat", "warmup": 1, "repeats": 2, "note": "synthetic",
    "denoising_steps": 8, "static_batch": 16,
}  # fmt: skip


def run(tokens_per_s: float) -> LevelResult:
    record = RequestRecord(0, "p", 0.0, 1.0, 0.5, (0.5,), 8, 64, "length", (8, 8), 16, 4.0)
    return LevelResult(summarize("x", "x", [record], 64 / tokens_per_s, 1), (record,))


def series(label: str, system: str, width: int, dtype: str, per_round: list[float]) -> Series:
    mode = "ar" if system.endswith("-ar") else "diffusion"
    return Series(label, system, mode, width, tuple(run(t) for t in per_round), dtype)


@pytest.fixture
def result() -> dict:
    runs = [
        series("canvas c=1", "canvas", 1, "float32", [100.0, 200.0]),
        series("canvas bf16 c=1", "canvas", 1, "bfloat16", [150.0, 200.0]),
        series("reference 1-at-a-time", "reference", 1, "float32", [50.0, 50.0]),
        series("reference bf16 1-at-a-time", "reference", 1, "bfloat16", [100.0, 100.0]),
        series("canvas c=16", "canvas", 16, "float32", [400.0, 400.0]),
        series("canvas bf16 c=16", "canvas", 16, "bfloat16", [560.0, 480.0]),
        series("reference static batch 16", "reference-batch", 16, "float32", [200.0, 200.0]),
        series("reference bf16 static batch 16", "reference-batch", 16, "bfloat16", [8.0, 8.0]),
    ]
    return assemble(META, runs, [])


def test_bf16_is_divided_by_its_fp32_twin_within_each_round(result):
    ratios = {r["name"]: r for r in result["ratios"]}
    assert ratios["canvas bf16 c=1 / canvas c=1"]["per_round"] == pytest.approx([1.5, 1.0])
    assert ratios["canvas bf16 c=16 / canvas c=16"]["per_round"] == pytest.approx([1.4, 1.2])
    twin = ratios["reference bf16 1-at-a-time / reference 1-at-a-time"]
    assert twin["per_round"] == pytest.approx([2.0, 2.0])
    # each dtype against the reference in its own dtype; the fp32 floor only for fp32
    assert ratios["canvas bf16 c=16 / reference bf16 static batch 16"]["median"] == 65.0
    assert ratios["canvas c=16 / reference static batch 16"]["median"] == 2.0
    assert "canvas bf16 c=16 / reference static batch 16" not in ratios
    assert not any(name.startswith("canvas bf16") and "floor" in name for name in ratios)
    goals = {g["ratio"]: g for g in result["goals"]}
    assert goals["canvas bf16 c=16 / canvas c=16"]["met"] is False  # median 1.3 - epsilon
    assert goals["canvas bf16 c=16 / canvas c=16"]["value"] == pytest.approx(1.3)
    assert goals["canvas bf16 c=1 / canvas c=1"]["met"] is True  # median 1.25 >= 1.0


def test_the_runs_table_has_the_bf16_over_fp32_column(result):
    report = bench_markdown(result)
    assert "| err | bf16 / fp32 median [min–max] |" in report
    rows: dict[str, str] = {}
    for line in report.splitlines():  # the runs table comes first: its row of each label
        rows.setdefault(line.split(" | ")[0].lstrip("| "), line)
    assert rows["canvas bf16 c=1"].endswith("| 1.25 [1.00–1.50] |")
    assert rows["canvas bf16 c=16"].endswith("| 1.30 [1.20–1.40] |")
    assert rows["canvas c=16"].endswith("| – |")


def test_each_configuration_runs_beside_its_twin_in_the_other_dtype():
    config = BenchConfig(concurrency=(1, 16), exact_concurrency=(16,), ar_concurrency=())
    servers = {
        (kind, dtype): SimpleNamespace(url=f"http://{kind}-{dtype}", model_name="m")
        for kind in ("fast", "exact", "overlap")
        for dtype in config.dtypes
    }
    references = {d: SimpleNamespace(generation_config=SimpleNamespace(pad_token_id=0), d=d)
                  for d in config.dtypes}  # fmt: skip
    prompts = tuple(make_prompts(config.prompt_set, 16, 0))
    todo = configurations(config, servers, references, prompts, [])  # type: ignore[arg-type]
    assert [(c.label, c.dtype) for c in todo] == [
        ("canvas c=1", "float32"),
        ("canvas bf16 c=1", "bfloat16"),
        ("reference 1-at-a-time", "float32"),
        ("reference bf16 1-at-a-time", "bfloat16"),
        ("canvas c=16", "float32"),
        ("canvas bf16 c=16", "bfloat16"),
        ("canvas-exact c=16", "float32"),
        ("canvas-exact bf16 c=16", "bfloat16"),
        ("canvas-overlap c=16", "float32"),
        ("canvas-overlap bf16 c=16", "bfloat16"),
        ("reference static batch 16", "float32"),
        ("reference bf16 static batch 16", "bfloat16"),
    ]


def test_dtypes_default_to_both_and_are_checked(capsys):
    (tiny,) = configs_from_args(build_parser().parse_args(["--size", "tiny"]))
    assert tiny.dtypes == ("float32", "bfloat16")
    (one,) = configs_from_args(
        build_parser().parse_args(["--size", "tiny", "--dtypes", "bfloat16"])
    )
    assert one.dtypes == ("bfloat16",)
    for bad in ((), ("float16",), ("float32", "float32")):
        with pytest.raises(ValueError, match="dtypes must"):
            BenchConfig(dtypes=bad)
    assert main(["--size", "toy", "--dtypes", "float32,float16"]) == 2  # before anything runs
    assert "bench: error: dtypes must be some of float32, bfloat16" in capsys.readouterr().err
