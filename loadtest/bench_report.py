"""The side-by-side benchmark's comparison: ratios, engine overhead, goals, markdown.

Every ratio divides two numbers measured in the same run on the same machine (CPU timings
vary run to run; ratios measured together are what can be compared). The goals are notes for
the reader, not assertions: a missed goal is reported, never raised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.report import (
    latency_series,
    markdown,
    plot_latency_cdf,
    plot_throughput,
    records_json,
    runs_table,
    write_json,
)
from loadtest.stats import RequestRecord, RunSummary

if TYPE_CHECKING:
    from loadtest.loadgen import LevelResult


@dataclass(frozen=True, slots=True)
class Measurements:
    """Every run of one benchmark, in the order they ran."""

    canvas: tuple[LevelResult, ...]  # diffusion, fast numerics (the default)
    canvas_ar: tuple[LevelResult, ...]
    reference_one: LevelResult  # one request at a time
    reference_batch: LevelResult  # static batches
    canvas_exact: tuple[LevelResult, ...] = ()  # diffusion, --exact numerics

    @property
    def runs(self) -> list[LevelResult]:
        return [
            *self.canvas,
            *self.canvas_ar,
            *self.canvas_exact,
            self.reference_one,
            self.reference_batch,
        ]


@dataclass(frozen=True, slots=True)
class Goal:
    key: str  # the comparison quantity, see `compare`
    op: str  # ">=" | "<=" | "<"
    target: float
    text: str  # {c}: the concurrency the goal is measured at

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        if self.op == ">=":
            return value >= self.target
        if self.op == "<=":
            return value <= self.target
        return value < self.target


GOALS = (
    Goal(
        "fraction_of_floor",
        ">=",
        0.8,
        "output tokens/s at {c} concurrent as a fraction of the fp32 FLOP floor",
    ),
    Goal(
        "throughput_vs_reference_one_at_a_time",
        ">=",
        4.0,
        "output tokens/s at {c} concurrent vs the reference one request at a time",
    ),
    Goal(
        "throughput_vs_reference_static_batch",
        ">=",
        1.3,
        "output tokens/s at {c} concurrent vs the reference static batch of {c}",
    ),
    Goal(
        "throughput_at_1_vs_reference",
        ">=",
        0.91,
        "output tokens/s at 1 request vs the reference one request at a time",
    ),
    Goal("latency_vs_reference", "<=", 1.1, "median latency at 1 request vs the reference's"),
    Goal(
        "engine_overhead_fraction",
        "<",
        0.10,
        "engine time outside the model forward at {c} concurrent (fraction of step time)",
    ),
)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def compare(
    canvas: Sequence[RunSummary],
    canvas_ar: Sequence[RunSummary],
    reference_one: RunSummary,
    reference_batch: RunSummary,
    canvas_exact: Sequence[RunSummary] = (),
    floor_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    """Canvas (fast, then exact numerics) against the reference and the FLOP floor at every
    concurrency, and AR mode against diffusion."""
    by_concurrency = []
    for numerics, runs in (("fast", canvas), ("exact", canvas_exact)):
        by_concurrency += [
            _canvas_row(s, numerics, reference_one, reference_batch, floor_tokens_per_s)
            for s in runs
        ]
    by_concurrency = _with_exact_ratio(by_concurrency)
    canvas_fast = [r for r in by_concurrency if r["numerics"] == "fast"]
    single = next((s for s in canvas if s.concurrency == 1), None)
    latency = {
        "canvas_p50_s": single.latency_s.p50 if single else None,
        "reference_p50_s": reference_one.latency_s.p50,
        "latency_vs_reference": ratio(
            single.latency_s.p50 if single else None, reference_one.latency_s.p50
        ),
        "throughput_at_1_vs_reference": ratio(
            single.output_tokens_per_s if single else None, reference_one.output_tokens_per_s
        ),
        "canvas_ttft_p50_s": single.ttft_s.p50 if single else None,
        "reference_ttft_p50_s": reference_one.ttft_s.p50,
    }
    diffusion = {r["concurrency"]: r["output_tokens_per_s"] for r in canvas_fast}
    ar_mode = [
        {
            "concurrency": s.concurrency,
            "output_tokens_per_s": s.output_tokens_per_s,
            "vs_diffusion_same_concurrency": ratio(
                s.output_tokens_per_s, diffusion.get(s.concurrency)
            ),
            "latency_p50_s": s.latency_s.p50,
        }
        for s in canvas_ar
    ]
    return {
        "reference_one_at_a_time_tokens_per_s": reference_one.output_tokens_per_s,
        "reference_static_batch_tokens_per_s": reference_batch.output_tokens_per_s,
        "floor_tokens_per_s": floor_tokens_per_s,
        "by_concurrency": by_concurrency,
        "latency_at_1": latency,
        "ar_mode": ar_mode,
    }


def _with_exact_ratio(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fast row gains its throughput over the exact row of the same concurrency."""
    exact = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["numerics"] == "exact"}
    for r in rows:
        r["fast_vs_exact"] = (
            ratio(r["output_tokens_per_s"], exact.get(r["concurrency"]))
            if r["numerics"] == "fast"
            else None
        )
    return rows


def _canvas_row(
    s: RunSummary,
    numerics: str,
    reference_one: RunSummary,
    reference_batch: RunSummary,
    floor_tokens_per_s: float | None,
) -> dict[str, Any]:
    overhead = s.engine_overhead
    return {
        "numerics": numerics,
        "concurrency": s.concurrency,
        "output_tokens_per_s": s.output_tokens_per_s,
        "fraction_of_floor": ratio(s.output_tokens_per_s, floor_tokens_per_s),
        "throughput_vs_reference_one_at_a_time": ratio(
            s.output_tokens_per_s, reference_one.output_tokens_per_s
        ),
        "throughput_vs_reference_static_batch": ratio(
            s.output_tokens_per_s, reference_batch.output_tokens_per_s
        ),
        "latency_p50_s": s.latency_s.p50,
        "engine_overhead_fraction": overhead.overhead_fraction if overhead else None,
        "mean_step_ms": overhead.mean_step_ms if overhead else None,
        "num_steps": overhead.num_steps if overhead else None,
    }


def evaluate_goals(comparison: dict[str, Any], goal_concurrency: int) -> list[dict[str, Any]]:
    """Each goal with its measured value (None when its run is not in the sweep)."""
    row = next(
        (
            r
            for r in comparison["by_concurrency"]
            if r["concurrency"] == goal_concurrency and r["numerics"] == "fast"
        ),
        {},
    )
    values = {**row, **comparison["latency_at_1"]}
    out = []
    for goal in GOALS:
        value = values.get(goal.key)
        out.append(
            {
                "goal": goal.text.format(c=goal_concurrency),
                "quantity": goal.key,
                "op": goal.op,
                "target": goal.target,
                "value": value,
                "met": goal.met(value),
            }
        )
    return out


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def bench_markdown(result: dict[str, Any], summaries: Sequence[RunSummary]) -> str:
    """The report: what was run, every run, the ratios, the overhead and the goals."""
    meta, comparison = result["meta"], result["comparison"]
    batch = meta["static_batch"]
    lines = [
        f"# Canvas vs the transformers reference — `{meta['preset']}`",
        "",
        f"Hardware: {meta['hardware']['cpu']} ({meta['hardware']['cpu_count']} CPUs), "
        f"torch {meta['torch_version']} with {meta['torch_threads']} threads. "
        f"Command: `{meta['command']}`.",
        "",
        f"Checkpoint: {meta['checkpoint_description']} ({meta['parameters']['total'] / 1e6:.1f}M "
        f"parameters, {meta['parameters']['active'] / 1e6:.1f}M active per token), canvas "
        f"{meta['canvas_length']}; {meta['max_tokens']} output tokens per request (EOS ignored), "
        f"prompt set `{meta['prompt_set']}`.",
        "",
        f"**{meta['note']}**",
        "",
        "## Runs",
        "",
        runs_table(summaries),
        "",
        "## Canvas vs the reference",
        "",
    ]
    header = (
        "numerics",
        "concurrency",
        "Canvas out tok/s",
        "of FLOP floor",
        "vs reference 1-at-a-time",
        f"vs reference static batch {batch}",
        "fast vs exact",
        "latency p50 (s)",
        "engine overhead",
        "mean step (ms)",
    )
    rows = [
        [
            r["numerics"],
            str(r["concurrency"]),
            f"{r['output_tokens_per_s']:.1f}",
            _pct(r["fraction_of_floor"]),
            _x(r["throughput_vs_reference_one_at_a_time"]),
            _x(r["throughput_vs_reference_static_batch"]),
            _x(r["fast_vs_exact"]),
            _s(r["latency_p50_s"]),
            _pct(r["engine_overhead_fraction"]),
            _ms(r["mean_step_ms"]),
        ]
        for r in comparison["by_concurrency"]
    ]
    floor = meta.get("floor") or {}
    lat = comparison["latency_at_1"]
    lines += [
        f"Reference: {comparison['reference_one_at_a_time_tokens_per_s']:.1f} out tok/s one "
        f"request at a time, {comparison['reference_static_batch_tokens_per_s']:.1f} in static "
        f"batches of {batch}. FLOP floor: {floor.get('floor_tokens_per_s', 0):.1f} out tok/s "
        f"({floor.get('gflops_per_canvas', 0):.2f} GFLOP per canvas at the measured fp32 GEMM "
        f"rate of {floor.get('gemm_gflop_per_s', 0):.0f} GFLOP/s). Engine overhead = step time "
        "outside the model forward and the sampler's arithmetic (`canvas:step_seconds` − "
        "`canvas:forward_seconds` − `canvas:sample_seconds`, over `canvas:step_seconds`).",
        "",
        markdown(header, rows),
        "",
        f"Latency at 1 request: Canvas p50 {_s(lat['canvas_p50_s'])} s vs reference "
        f"{_s(lat['reference_p50_s'])} s ({_x(lat['latency_vs_reference'])}); time to first "
        f"canvas {_s(lat['canvas_ttft_p50_s'])} s vs {_s(lat['reference_ttft_p50_s'])} s.",
        "",
    ]
    if comparison["ar_mode"]:
        ar_rows = [
            [
                str(r["concurrency"]),
                f"{r['output_tokens_per_s']:.1f}",
                _x(r["vs_diffusion_same_concurrency"]),
                _s(r["latency_p50_s"]),
            ]
            for r in comparison["ar_mode"]
        ]
        ar_header = ("concurrency", "AR out tok/s", "vs diffusion", "latency p50 (s)")
        lines += ["## Canvas AR mode (same checkpoint)", "", markdown(ar_header, ar_rows), ""]
    goal_rows = [
        [
            g["goal"],
            f"{g['op']} {g['target']:g}",
            _s(g["value"]),
            {True: "yes", False: "NO", None: "–"}[g["met"]],
        ]
        for g in result["goals"]
    ]
    checks = result["checks"]
    lines += [
        "## Goals (notes, not asserts)",
        "",
        markdown(("goal", "target", "measured", "met"), goal_rows),
        "",
        f"Checks: every Canvas canvas ran {meta['denoising_steps']} steps: "
        f"{checks['canvas_fixed_steps']}; every reference canvas did: "
        f"{checks['reference_fixed_steps']}; failed requests: {checks['num_errors']}.",
    ]
    return "\n".join(lines) + "\n"


def fixed_steps(records: Sequence[RequestRecord], steps: int) -> bool:
    """Every canvas of every successful request ran exactly `steps` steps (and there was one)."""
    counts = [n for r in records if r.ok for n in r.steps_per_canvas]
    return bool(counts) and all(n == steps for n in counts)


def assemble(meta: dict[str, Any], runs: Measurements) -> dict[str, Any]:
    """The JSON document: meta, every run with its records, the comparison, goals, checks."""
    comparison = compare(
        [r.summary for r in runs.canvas],
        [r.summary for r in runs.canvas_ar],
        runs.reference_one.summary,
        runs.reference_batch.summary,
        [r.summary for r in runs.canvas_exact],
        (meta.get("floor") or {}).get("floor_tokens_per_s"),
    )
    steps = meta["denoising_steps"]
    reference = [*runs.reference_one.records, *runs.reference_batch.records]
    return {
        "meta": meta,
        "runs": [{**r.summary.to_dict(), "records": records_json(r.records)} for r in runs.runs],
        "comparison": comparison,
        "goals": evaluate_goals(comparison, meta["static_batch"]),
        "checks": {
            "canvas_fixed_steps": fixed_steps(
                [x for r in (*runs.canvas, *runs.canvas_exact) for x in r.records], steps
            ),
            "reference_fixed_steps": fixed_steps(reference, steps),
            "num_errors": sum(r.summary.num_errors for r in runs.runs),
        },
    }


def write_bench_report(out: Path, result: dict[str, Any], runs: Measurements) -> str:
    """Write results.json, results.md, throughput.png, latency_cdf.png; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    report = bench_markdown(result, [r.summary for r in runs.runs])
    (out / "results.md").write_text(report)
    baselines = {
        runs.reference_one.summary.label: runs.reference_one.summary.output_tokens_per_s,
        runs.reference_batch.summary.label: runs.reference_batch.summary.output_tokens_per_s,
    }
    canvas = [*runs.canvas, *runs.canvas_ar, *runs.canvas_exact]  # reference: no concurrency
    plot_throughput([r.summary for r in canvas], out / "throughput.png", baselines)
    cdf = [*canvas, runs.reference_one]
    plot_latency_cdf(
        latency_series([(r.summary.label, r.records) for r in cdf]), out / "latency_cdf.png"
    )
    return report
