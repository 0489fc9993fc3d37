"""Reports: a markdown table of runs, JSON files, and PNG plots.

matplotlib is optional (the `bench` extra) and imported only when a plot is drawn: without it
the plots are skipped with a log line and everything else is still written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.load.stats import RequestRecord, RunSummary

if TYPE_CHECKING:
    from loadtest.load.loadgen import LevelResult, LoadConfig

logger = logging.getLogger(__name__)

TABLE_COLUMNS = (
    "run",
    "req",
    "err",
    "req/s",
    "out tok/s",
    "TTFT p50 (s)",
    "TTFT p99 (s)",
    "latency p50 (s)",
    "latency p90 (s)",
    "latency p99 (s)",
    "canvas p50 (ms)",
    "steps/canvas",
    "TPF",
    "overhead",
)


def _num(value: float | None, digits: int = 2, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def summary_row(s: RunSummary) -> list[str]:
    overhead = s.engine_overhead.overhead_fraction if s.engine_overhead else None
    return [
        s.label,
        str(s.num_requests),
        str(s.num_errors),
        _num(s.requests_per_s, 3),
        _num(s.output_tokens_per_s, 1),
        _num(s.ttft_s.p50, 3),
        _num(s.ttft_s.p99, 3),
        _num(s.latency_s.p50, 3),
        _num(s.latency_s.p90, 3),
        _num(s.latency_s.p99, 3),
        _num(s.canvas_s.p50, 1, 1e3),
        _num(s.steps_per_canvas, 1),
        _num(s.tokens_per_forward, 2),
        _pct(overhead),
    ]


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def runs_table(summaries: Sequence[RunSummary]) -> str:
    """One row per run: throughput, latency percentiles, diffusion stats, engine overhead."""
    return markdown(TABLE_COLUMNS, [summary_row(s) for s in summaries])


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def records_json(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


def _pyplot() -> Any | None:
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed (pip install '.[bench]'): no plots")
        return None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(
    summaries: Sequence[RunSummary],
    path: Path,
    baselines: Mapping[str, float] | None = None,
    title: str = "Output throughput vs concurrency",
) -> bool:
    """Output tokens/s against concurrency, one line per system; baselines (tokens/s that have
    no concurrency axis, e.g. the reference) as horizontal lines. False when not drawn."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = dict.fromkeys(s.system for s in summaries if s.concurrency is not None)
    for system in systems:
        points = sorted(
            (s.concurrency, s.output_tokens_per_s)
            for s in summaries
            if s.system == system and s.concurrency is not None
        )
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=system)
    for i, (name, value) in enumerate((baselines or {}).items()):
        ax.axhline(value, linestyle="--", color=f"C{i + len(systems)}", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_latency_cdf(
    series: Mapping[str, Sequence[float]], path: Path, title: str = "Request latency CDF"
) -> bool:
    """Empirical CDF of request latency (seconds), one curve per run. False when not drawn."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        ordered = sorted(values)
        if not ordered:
            continue
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, fractions, where="post", label=name)
    values = [v for vs in series.values() for v in vs if v > 0]
    if values and max(values) > 20 * min(values):
        ax.set_xscale("log")  # runs that differ by orders of magnitude stay readable
    ax.set_xlabel("latency (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def latency_series(results: Sequence[tuple[str, Sequence[RequestRecord]]]) -> dict[str, list]:
    return {label: [r.latency for r in records if r.ok] for label, records in results}


def write_loadgen_report(out: Path, config: LoadConfig, results: Sequence[LevelResult]) -> str:
    """Write results.json, results.md, throughput.png and latency_cdf.png under `out`; return
    the markdown table."""
    summaries = [r.summary for r in results]
    table = runs_table(summaries)
    spec = asdict(config.spec)
    write_json(
        out / "results.json",
        {
            "url": config.url,
            "request": spec,
            "num_requests": config.num_requests,
            "duration_s": config.duration_s,
            "warmup": config.warmup,
            "levels": [
                {"summary": r.summary.to_dict(), "records": records_json(r.records)}
                for r in results
            ],
        },
    )
    (out / "results.md").write_text(table + "\n")
    if any(s.concurrency is not None for s in summaries):
        plot_throughput(summaries, out / "throughput.png")
    plot_latency_cdf(
        latency_series([(r.summary.label, r.records) for r in results]), out / "latency_cdf.png"
    )
    return table
