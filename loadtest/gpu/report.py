"""The GPU benchmark's report: its record (`BenchReport`), the JSON and markdown files written
from it, and the short summary printed last (see `loadtest.gpu.bench`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.gpu.kernel_timing import Ceilings, KernelTiming


@dataclass(frozen=True, slots=True)
class EngineTiming:
    """The engine's denoising step at one batch of canvases (every canvas in every step)."""

    canvases: int
    step_ms: float  # median over the timed denoising steps
    step_ms_min: float
    forward_ms: float  # median model forward (runner.execute, synchronised) of those steps
    prefill_ms: float | None
    timed_steps: int
    tokens_per_s: float  # canvases * canvas / (steps * step)
    floor_share: float  # weight-streaming floor / step
    peak_memory_gb: float | None
    steps_per_canvas: list[int]  # distinct values over the timed requests: [steps] when right
    # Median time between two denoising steps' hand-overs, stepped as the server steps (no
    # sync): serially, and with steps run ahead (`--overlap`); None: fewer than two such steps.
    serial_period_ms: float | None = None
    overlap_period_ms: float | None = None


@dataclass(slots=True)
class BenchReport:
    meta: dict[str, Any]
    ceilings: Ceilings | None = None
    floor_ms: float | None = None  # all weight bytes at the measured copy bandwidth
    engine: list[EngineTiming] = field(default_factory=list)
    kernels: list[KernelTiming] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # batch sizes left out for time
    errors: list[str] = field(default_factory=list)  # what failed (tracebacks in the log)

    def checks_pass(self) -> bool:
        """Nothing failed, some batch was timed, and every timed canvas ran exactly the fixed
        step count."""
        steps = self.meta["denoising_steps"]
        right = all(e.steps_per_canvas == [steps] for e in self.engine)
        return bool(self.engine) and right and not self.errors

    def to_json(self) -> dict[str, Any]:
        c = self.ceilings
        return {
            "meta": self.meta,
            "ceilings": asdict(c) if c else None,
            "weight_streaming_floor_ms": self.floor_ms,
            "engine": [asdict(e) for e in self.engine],
            "kernels": [asdict(k) | (k.rates(c) if c else {}) for k in self.kernels],
            "skipped": self.skipped,
            "errors": self.errors,
            "checks_pass": self.checks_pass(),
            "summary": summary(self),
        }


def md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _engine_rows(report: BenchReport) -> list[list[str]]:
    return [
        [
            str(e.canvases),
            f"{e.step_ms:.2f}",
            f"{e.forward_ms:.2f}",
            f"{e.step_ms - e.forward_ms:.2f}",
            "-" if e.prefill_ms is None else f"{e.prefill_ms:.2f}",
            f"{e.tokens_per_s:,.0f}",
            _pct(e.floor_share),
            "-" if e.peak_memory_gb is None else f"{e.peak_memory_gb:.1f}",
            ",".join(map(str, e.steps_per_canvas)),
            " / ".join(
                "-" if v is None else f"{v:.2f}" for v in (e.serial_period_ms, e.overlap_period_ms)
            ),
        ]
        for e in report.engine
    ]


def _kernel_rows(report: BenchReport) -> list[list[str]]:
    assert report.ceilings is not None
    rows = []
    for k in report.kernels:
        r = k.rates(report.ceilings)
        rows.append(
            [
                k.name,
                str(k.canvases),
                f"{k.ms:.3f}",
                f"{r['gb_per_s']:,.1f}",
                _pct(r["copy_share"]),
                f"{r['tflop_per_s']:.2f}",
                _pct(r["gemm_share"]) if k.flops else "-",
            ]
        )
    return rows


ENGINE_HEADERS = [
    "canvases",
    "step ms",
    "forward ms",
    "sample+host ms",
    "prompt step ms",
    "tok/s",
    "floor/step",
    "peak GB",
    "steps/canvas",
    "step period ms, serial / --overlap",
]
KERNEL_HEADERS = ["kernel", "canvases", "ms", "GB/s", "of copy", "TFLOP/s", "of GEMM"]


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def markdown(report: BenchReport) -> str:
    m, c, sh = report.meta, report.ceilings, report.meta["shapes"]
    dry = " (dry run: the timings mean nothing)" if m["dry_run"] else ""
    lines = [
        f"# Canvas on {m['device']}{dry}",
        "",
        f"{m.get('kernels', m['backend'])}, {m['dtype']}; {m['versions']}. "
        f"Command: `{m['command']}`.",
        "",
        f"Shapes: {sh['layers']} layers (full: {sh['full_layers']}), hidden {sh['hidden']}, "
        f"{sh['heads']} query heads, sliding KV heads x dim {sh['sliding_kv_heads_x_dim']}, full "
        f"{sh['full_kv_heads_x_dim']}, window {sh['window']}, dense {sh['dense']}, experts x "
        f"top-k x size {sh['experts']}, vocab {sh['vocab']}, canvas {sh['canvas']}: "
        f"{_count(sh['parameters'])} parameters, {m.get('weight_bytes', 0) / 1e9:.2f} GB of "
        "weights.",
    ]
    if c is not None and report.floor_ms is not None:
        lines += [
            "",
            f"Ceilings measured here: copy {c.copy_bytes_per_s / 1e9:,.0f} GB/s (read + write), "
            f"{m['dtype']} GEMM {c.gemm_flop_per_s / 1e12:,.1f} TFLOP/s. Weight-streaming floor "
            f"(all weights read once at the copy bandwidth): {report.floor_ms:.2f} ms per step.",
        ]
    lines += [
        "",
        f"## Engine step: {m['denoising_steps']} fixed denoising steps per canvas, prompts of "
        f"{m['prompt_len']} tokens",
        "",
        "Median step; forward = the model pass (synchronised), the rest is sampling, scheduling "
        "and the host transfer; tok/s = canvases x canvas / (steps x step); floor/step = the "
        "weight-streaming floor over the step.",
        "",
        *md_table(ENGINE_HEADERS, _engine_rows(report)),
    ]
    if report.kernels:
        lines += [
            "",
            f"## Kernels: canvases of {sh['canvas']} positions after {m['kernel_prefix']} "
            "cached positions",
            "",
            *md_table(KERNEL_HEADERS, _kernel_rows(report)),
        ]
    if report.skipped:
        lines += ["", "Skipped: " + "; ".join(report.skipped)]
    if report.errors:
        lines += ["", "**Errors** (tracebacks in the log):", "", *(f"- {e}" for e in report.errors)]
    return "\n".join(lines) + "\n"


def summary(report: BenchReport) -> str:
    """The headline numbers, a few lines."""
    m = report.meta
    steps = " ".join(f"{e.canvases}:{e.step_ms:.1f}ms" for e in report.engine) or "none"
    tps = " ".join(f"{e.canvases}:{e.tokens_per_s:,.0f}" for e in report.engine) or "none"
    mem = " ".join(
        f"{e.canvases}:{e.peak_memory_gb:.0f}GB"
        for e in report.engine
        if e.peak_memory_gb is not None
    )
    floor = "-" if report.floor_ms is None else f"{report.floor_ms:.2f} ms"
    lines = [
        f"gpu_bench{' (dry run)' if m['dry_run'] else ''}: {m['device']}, "
        f"{m.get('kernels', m['backend'])}, {m['dtype']}, {m.get('seconds', 0.0):.0f} s; "
        f"checks {'pass' if report.checks_pass() else 'FAIL'}",
        f"  engine step (canvases:median) {steps}; weight-streaming floor {floor}",
        f"  tokens/s at {m['denoising_steps']} steps {tps}"
        + (f"; peak memory {mem}" if mem else ""),
    ]
    if report.skipped:
        lines.append(f"  skipped: {'; '.join(report.skipped)}")
    if report.errors:
        lines.append(f"  ERRORS: {'; '.join(e[:160] for e in report.errors)}")
    return "\n".join(lines)


def write_reports(report: BenchReport, json_path: Path, md_path: Path) -> None:
    for path in (json_path, md_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report.to_json(), indent=2, default=str) + "\n")
    md_path.write_text(markdown(report))
