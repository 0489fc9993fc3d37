"""The side-by-side benchmark's comparison: spreads, ratios per round, step breakdown, goals.

Every configuration ran once per round, all in a fixed order (`loadtest.cpu.bench_runs`), so a
ratio is computed within each round from neighbouring runs and reported as its values per
round with their min / median / max; this VM's speed drifts between minutes, and a ratio of a
fast minute over a slow one is not a result. The goals are notes for the reader, judged on the
median, never raised.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.cpu.bench_config import DTYPE_TAGS
from loadtest.cpu.bench_runs import Series
from loadtest.load.report import (
    latency_series,
    markdown,
    plot_latency_cdf,
    plot_throughput,
    records_json,
    write_json,
)
from loadtest.load.stats import RequestRecord, RunSummary


@dataclass(frozen=True, slots=True)
class Goal:
    ratio: str  # the name of a ratio (see `ratio_specs`)
    op: str  # ">=" | "<=" | "<"
    target: float

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        if self.op == ">=":
            return value >= self.target
        if self.op == "<=":
            return value <= self.target
        return value < self.target


@dataclass(frozen=True, slots=True)
class RatioSpec:
    """numerator / denominator, each a configuration's quantity in the same round."""

    name: str
    numerator: str  # configuration label
    denominator: str | None  # configuration label; None: `quantity` is a fraction on its own
    quantity: str  # "throughput" | "latency" | "floor" | "overhead" | "hidden"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"min": None, "median": None, "max": None}
    return {"min": min(known), "median": statistics.median(known), "max": max(known)}


def ratio_specs(series: Sequence[Series], static_batch: int) -> list[RatioSpec]:
    """Canvas against the reference in the same dtype at every concurrency (diffusion: fast and
    exact; AR), fast against exact, the FLOP floor (fp32's: its rate is the fp32 GEMM's), engine
    overhead, latency at one request; then every configuration in bf16 against itself in fp32
    (`bf16_specs`)."""
    labels = {s.label for s in series}
    specs: list[RatioSpec] = []
    for s in series:
        tag = DTYPE_TAGS[s.dtype]
        one, batch = f"reference{tag} 1-at-a-time", f"reference{tag} static batch {static_batch}"
        ar_one = f"reference-ar{tag} 1-at-a-time"
        ar_batch = f"reference-ar{tag} static batch {static_batch}"
        if s.system in ("canvas", "canvas-exact"):
            if s.system == "canvas" and s.dtype == "float32":  # the floor's rate is fp32's
                specs.append(RatioSpec(f"{s.label} / floor", s.label, None, "floor"))
                specs.append(RatioSpec(f"{s.label} / decode floor", s.label, None, "decode floor"))
            specs.append(RatioSpec(f"{s.label} / {one}", s.label, one, "throughput"))
            specs.append(RatioSpec(f"{s.label} / {batch}", s.label, batch, "throughput"))
            exact = f"canvas-exact{tag} c={s.width}"
            if s.system == "canvas" and exact in labels:
                specs.append(RatioSpec(f"{s.label} / {exact}", s.label, exact, "throughput"))
        if s.system == "canvas-ar":
            if s.width == 1:
                specs.append(RatioSpec(f"{s.label} / {ar_one}", s.label, ar_one, "throughput"))
            if s.width == static_batch:  # the plain loop (the baseline) and its batch
                specs.append(RatioSpec(f"{s.label} / {ar_one}", s.label, ar_one, "throughput"))
                specs.append(RatioSpec(f"{s.label} / {ar_batch}", s.label, ar_batch, "throughput"))
        if s.system == "canvas-overlap":  # against the serial loop at the same width
            serial = f"canvas{tag} c={s.width}"
            specs.append(RatioSpec(f"{s.label} / {serial}", s.label, serial, "throughput"))
            specs.append(RatioSpec(f"{s.label} overhead hidden", s.label, serial, "hidden"))
        if s.system in ("canvas", "canvas-ar", "canvas-overlap"):
            specs.append(RatioSpec(f"{s.label} engine overhead", s.label, None, "overhead"))
    for s in series:
        if s.system == "canvas" and s.width == 1:
            one = f"reference{DTYPE_TAGS[s.dtype]} 1-at-a-time"
            specs.append(RatioSpec(f"latency {s.label} / {one}", s.label, one, "latency"))
    specs += bf16_specs(series)
    return [r for r in specs if r.denominator is None or r.denominator in labels]


def fp32_twin(label: str, dtype: str) -> str | None:
    """The label of configuration `label`'s twin in fp32 (None: it is fp32)."""
    tag = DTYPE_TAGS[dtype]
    return label.replace(tag, DTYPE_TAGS["float32"], 1) if tag else None


def bf16_specs(series: Sequence[Series]) -> list[RatioSpec]:
    """Throughput of every bf16 configuration over its fp32 twin's (same system, width and
    shape, timed beside it in each round)."""
    twins = [(s.label, fp32_twin(s.label, s.dtype)) for s in series if s.dtype == "bfloat16"]
    return [RatioSpec(f"{b} / {f}", b, f, "throughput") for b, f in twins if f is not None]


def dtypes_of(series: Sequence[Series]) -> tuple[str, ...]:
    """The dtypes `series` ran in, in order of first appearance."""
    return tuple(dict.fromkeys(s.dtype for s in series))


def goals(
    static_batch: int, dtypes: Sequence[str] = ("float32",), overlap: bool = False
) -> tuple[Goal, ...]:
    """The goals of each dtype's Canvas against its reference, and with bf16 and fp32 both run,
    bf16 Canvas against fp32 Canvas (issue 44: >= 1.3x at 16 at once, >= 1.0x at one); with
    `overlap` run, the share of the serial loop's engine overhead that it hides (issue 46)."""
    b = static_batch
    out: list[Goal] = []
    for dtype in dtypes:
        t = DTYPE_TAGS[dtype]
        out.append(Goal(f"canvas{t} c={b} / reference{t} static batch {b}", ">=", 1.3))
        if dtype == "float32":
            out.append(Goal(f"canvas c={b} / floor", ">=", 0.6))
        out += (
            Goal(f"canvas{t} c=1 / reference{t} 1-at-a-time", ">=", 1.0),
            Goal(f"latency canvas{t} c=1 / reference{t} 1-at-a-time", "<=", 1.0),
            Goal(f"canvas-ar{t} c=1 / reference-ar{t} 1-at-a-time", ">=", 1.0),
            # "≥ 3× a plain greedy KV-cached loop at 16": the loop serves one request at a time
            # (its static batch, a stronger baseline, is reported beside it without a goal).
            Goal(f"canvas-ar{t} c={b} / reference-ar{t} 1-at-a-time", ">=", 3.0),
            Goal(f"canvas{t} c=1 engine overhead", "<", 0.10),
            Goal(f"canvas{t} c={b} engine overhead", "<", 0.10),
        )
        if overlap:
            out.append(Goal(f"canvas-overlap{t} c={b} overhead hidden", ">=", 0.5))
    if {"float32", "bfloat16"} <= set(dtypes):
        bf = DTYPE_TAGS["bfloat16"]
        out += (
            Goal(f"canvas{bf} c={b} / canvas c={b}", ">=", 1.3),
            Goal(f"canvas{bf} c=1 / canvas c=1", ">=", 1.0),
        )
    return tuple(out)


QUANTITY: dict[str, Callable[[RunSummary], float | None]] = {
    "throughput": lambda s: s.output_tokens_per_s,
    "latency": lambda s: s.latency_s.p50,
    "floor": lambda s: s.output_tokens_per_s,
    "decode floor": lambda s: s.output_tokens_per_s,
    "overhead": lambda s: s.engine_overhead.overhead_fraction if s.engine_overhead else None,
    "hidden": lambda s: s.engine_overhead.overhead_per_step if s.engine_overhead else None,
}


FloorRate = float | Sequence[float] | None  # one floor, or one per round


def compare(
    series: Sequence[Series],
    static_batch: int,
    floor_tokens_per_s: FloorRate,
    decode_floor_tokens_per_s: FloorRate = None,
) -> list[dict[str, Any]]:
    """Each ratio's value per round (numerator and denominator from the same round; a floor
    given per round: that round's), with their spread."""
    floors = {"floor": floor_tokens_per_s, "decode floor": decode_floor_tokens_per_s}
    by_label = {s.label: s for s in series}
    out = []
    for spec in ratio_specs(series, static_batch):
        top = by_label[spec.numerator].runs
        bottom = by_label[spec.denominator].runs if spec.denominator else None
        values = []
        for r, run in enumerate(top):
            value = QUANTITY[spec.quantity](run.summary)
            if spec.quantity in floors:
                floor = floors[spec.quantity]
                value = ratio(value, floor[r] if isinstance(floor, Sequence) else floor)
            elif bottom is not None:
                value = ratio(value, QUANTITY[spec.quantity](bottom[r].summary))
                if spec.quantity == "hidden" and value is not None:  # 1 - ours / the serial one
                    value = 1 - value
            values.append(value)
        out.append({"name": spec.name, "quantity": spec.quantity, "per_round": values})
        out[-1].update(spread(values))
    return out


def step_breakdown(summary: RunSummary) -> dict[str, float | None]:
    """Mean milliseconds per step: the whole step, the forward, the sampler and the rest."""
    o = summary.engine_overhead
    if o is None or not o.num_steps:
        return {"steps": None, "step_ms": None, "forward_ms": None, "sample_ms": None}
    per = 1e3 / o.num_steps
    return {
        "steps": o.num_steps,
        "step_ms": o.step_seconds * per,
        "forward_ms": o.forward_seconds * per,
        "sample_ms": o.sample_seconds * per,
    }


def thread_shares(runs: Sequence[dict[str, Any]]) -> str:
    """The share of a series' steps (all rounds) run with each CPU thread count, e.g. "1: 97%,
    2: 3%"; "–" where the server does not report it (the reference, a fixed count on GPU)."""
    counts: dict[str, int] = {}
    for run in runs:
        for n, k in ((run.get("engine_overhead") or {}).get("thread_steps") or {}).items():
            counts[n] = counts.get(n, 0) + k
    total = sum(counts.values())
    if not total:
        return "–"
    return ", ".join(
        f"{n}: {100 * k / total:.0f}%" for n, k in sorted(counts.items(), key=lambda x: int(x[0]))
    )


def series_json(s: Series) -> dict[str, Any]:
    throughputs = [r.summary.output_tokens_per_s for r in s.runs]
    steps = [step_breakdown(r.summary) for r in s.runs]
    return {
        "label": s.label,
        "dtype": s.dtype,
        "system": s.system,
        "mode": s.mode,
        "width": s.width,
        "output_tokens_per_s": {"per_round": throughputs, **spread(throughputs)},
        "latency_p50_s": spread([r.summary.latency_s.p50 for r in s.runs]),
        "step_ms": {k: spread([x[k] for x in steps]) for k in steps[0]},
        "runs": [{**r.summary.to_dict(), "records": records_json(r.records)} for r in s.runs],
    }


def fixed_steps(records: Sequence[RequestRecord], steps: int) -> bool:
    """Every canvas of every successful request ran exactly `steps` steps (and there was one)."""
    counts = [n for r in records if r.ok for n in r.steps_per_canvas]
    return bool(counts) and all(n == steps for n in counts)


def assemble(meta: dict[str, Any], series: Sequence[Series], ledger: list[dict]) -> dict[str, Any]:
    """The JSON document: meta, every configuration's runs, the ratios, goals, checks and the
    ledger of warm-ups and timed runs."""
    batch = meta["static_batch"]
    floor = meta.get("floor") or {}
    ratios = compare(
        series,
        batch,
        floor.get("floor_tokens_per_s_per_round") or floor.get("floor_tokens_per_s"),
        floor.get("decode_floor_tokens_per_s_per_round") or floor.get("decode_floor_tokens_per_s"),
    )
    medians = {r["name"]: r["median"] for r in ratios}
    steps = meta["denoising_steps"]

    def records(systems: tuple[str, ...]) -> list[RequestRecord]:
        return [x for s in series if s.system in systems for r in s.runs for x in r.records]

    return {
        "meta": meta,
        "series": [series_json(s) for s in series],
        "ratios": ratios,
        "goals": [
            {
                "ratio": g.ratio,
                "op": g.op,
                "target": g.target,
                "value": medians.get(g.ratio),
                "met": g.met(medians.get(g.ratio)),
            }
            for g in goals(
                batch, dtypes_of(series), any(s.system == "canvas-overlap" for s in series)
            )
        ],
        "checks": {
            "canvas_fixed_steps": fixed_steps(
                records(("canvas", "canvas-exact", "canvas-overlap")), steps
            ),
            "reference_fixed_steps": fixed_steps(records(("reference", "reference-batch")), steps),
            "num_errors": sum(r.summary.num_errors for s in series for r in s.runs),
        },
        "ledger": ledger,
    }


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _rates(floor: dict[str, Any]) -> str:
    return " · ".join(_f(r, 0) for r in floor.get("gemm_gflop_per_s_per_round", [])) or "–"


def _spread(d: dict[str, float | None], digits: int = 1) -> str:
    return f"{_f(d['min'], digits)} / {_f(d['median'], digits)} / {_f(d['max'], digits)}"


def _over_fp32(s: dict[str, Any], ratios: dict[str, dict[str, Any]]) -> str:
    """A bf16 configuration's throughput over its fp32 twin's: the median of the rounds' ratios
    and their range; "–" for an fp32 configuration or one without a twin."""
    twin = fp32_twin(s["label"], s["dtype"])
    r = ratios.get(f"{s['label']} / {twin}") if twin else None
    if r is None or r["median"] is None:
        return "–"
    return f"{_f(r['median'], 2)} [{_f(r['min'], 2)}–{_f(r['max'], 2)}]"


def _runs_section(result: dict[str, Any]) -> list[str]:
    rows = []
    ratios = {r["name"]: r for r in result["ratios"]}
    for s in result["series"]:
        tput = s["output_tokens_per_s"]
        first = s["runs"][0]
        rows.append(
            [
                s["label"],
                str(first["num_requests"]),
                " · ".join(_f(v) for v in tput["per_round"]),
                _spread(tput),
                _spread(s["latency_p50_s"], 3),
                _f(first["steps_per_canvas"]),
                _f(first["tokens_per_forward"], 2),
                str(sum(r["num_errors"] for r in s["runs"])),
                _over_fp32(s, ratios),
            ]
        )
    header = (
        "configuration", "req", "out tok/s per round", "min / median / max",
        "latency p50 (s) min / median / max", "steps/canvas", "TPF", "err",
        "bf16 / fp32 median [min–max]",
    )  # fmt: skip
    title = "## Runs (each warmed at its shape, then timed once per round)"
    note = (
        "Labels without a dtype ran in float32, both Canvas and the reference; `bf16`: both in "
        "bfloat16. bf16 / fp32: a bf16 configuration's out tok/s over its fp32 twin's, timed "
        "beside it in each round."
    )
    return [title, "", note, "", markdown(header, rows), ""]


def _steps_section(result: dict[str, Any]) -> list[str]:
    rows = []
    for s in result["series"]:
        ms = {k: v["median"] for k, v in s["step_ms"].items()}
        rest = None
        if ms["step_ms"] is not None:
            rest = ms["step_ms"] - (ms["forward_ms"] or 0.0) - (ms["sample_ms"] or 0.0)
        rows.append(
            [
                s["label"],
                _f(ms["steps"], 0),
                _f(ms["step_ms"]),
                _f(ms["forward_ms"]),
                _f(ms["sample_ms"]),
                _f(rest),
                "–" if rest is None or not ms["step_ms"] else f"{100 * rest / ms['step_ms']:.1f}%",
            ]
        )
    header = (
        "configuration", "steps", "step (ms)", "forward (ms)", "sampler (ms)", "rest (ms)", "rest",
    )  # fmt: skip
    return [
        "## Per step (medians over rounds)",
        "",
        "Canvas: the server's `canvas:step_seconds`, `canvas:forward_seconds` and "
        "`canvas:sample_seconds` over the run, per engine step. Reference: the run's wall time "
        "per step (a `generate()` denoising step over its whole batch; AR: one encoder pass), its "
        "encoder, decoder and LM-head forwards (module hooks), the sampler (the denoising step "
        "outside its forward; AR: the argmax), the rest (Python, commits, padding).",
        "",
        markdown(header, rows),
        "",
    ]


def _ratios_section(result: dict[str, Any]) -> list[str]:
    rounds = max((len(r["per_round"]) for r in result["ratios"]), default=0)
    rows = [
        [
            r["name"],
            *[_f(v, 2) for v in r["per_round"]],
            _f(r["min"], 2),
            _f(r["median"], 2),
            _f(r["max"], 2),
        ]
        for r in result["ratios"]
    ]
    header = ("ratio", *[f"round {i + 1}" for i in range(rounds)], "min", "median", "max")
    return [
        "## Ratios (within each round, from neighbouring runs)",
        "",
        "Throughput ratios divide output tokens/s; `/ floor` is the fraction of the fp32 FLOP "
        "floor; latency divides the p50 latencies; engine overhead is the step's share outside "
        "the forward and the sampler; overhead hidden is 1 - `--overlap`'s engine time per step "
        "outside them / the serial loop's (a step run ahead lasts from its forward's start to "
        "the next one's).",
        "",
        markdown(header, rows),
        "",
    ]


def bench_markdown(result: dict[str, Any]) -> str:
    """The report: what was run, every configuration's runs, the step breakdown, the ratios,
    the goals and the checks."""
    meta = result["meta"]
    floor = meta.get("floor") or {}
    lines = [
        f"# Canvas vs the transformers reference — `{meta['preset']}`",
        "",
        f"Hardware: {meta['hardware']['cpu']} ({meta['hardware']['cpu_count']} CPUs), "
        f"torch {meta['torch_version']}; the reference with {meta['torch_threads']} threads, "
        f"Canvas with {meta.get('canvas_server_threads', meta['torch_threads'])}. "
        f"Command: `{meta['command']}`.",
        "",
        f"Checkpoint: {meta['checkpoint_description']} ({meta['parameters']['total'] / 1e6:.1f}M "
        f"parameters, {meta['parameters']['active'] / 1e6:.1f}M active per token), canvas "
        f"{meta['canvas_length']}; {meta['max_tokens']} output tokens per request (EOS ignored), "
        f"prompt set `{meta['prompt_set']}`; {meta['warmup']} warm-up and {meta['repeats']} "
        f"timed runs per configuration. FLOP floor: {_f(floor.get('floor_tokens_per_s'))} out "
        f"tok/s ({_f(floor.get('gflops_per_canvas'), 3)} GFLOP per canvas for its steps and "
        f"commit and {_f(floor.get('gflops_prompt_per_canvas'), 3)} for its share of the "
        f"prompt's prefill, at the measured fp32 GEMM rate of "
        f"{_f(floor.get('gemm_gflop_per_s'), 0)} GFLOP/s, the median of the rounds' "
        f"{_rates(floor)}; each round's runs are set against its own rate); without the prompts "
        f"(the decode floor): {_f(floor.get('decode_floor_tokens_per_s'))} out tok/s.",
        "",
        f"**{meta['note']}**",
        "",
        *_runs_section(result),
        *_steps_section(result),
        *_ratios_section(result),
    ]
    goal_rows = [
        [
            g["ratio"],
            f"{g['op']} {g['target']:g}",
            _f(g["value"], 3),
            {True: "yes", False: "NO", None: "–"}[g["met"]],
        ]
        for g in result["goals"]
    ]
    checks = result["checks"]
    lines += [
        "## Goals (medians; notes, not asserts)",
        "",
        markdown(("ratio", "target", "median", "met"), goal_rows),
        "",
        f"Checks: every Canvas canvas ran {meta['denoising_steps']} steps: "
        f"{checks['canvas_fixed_steps']}; every reference canvas did: "
        f"{checks['reference_fixed_steps']}; failed requests: {checks['num_errors']}.",
    ]
    return "\n".join(lines) + "\n"


def _median_run(s: Series) -> RunSummary:
    ordered = sorted((r.summary for r in s.runs), key=lambda x: x.output_tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def write_bench_report(out: Path, result: dict[str, Any], series: Sequence[Series]) -> str:
    """Write results.json, results.md, throughput.png, latency_cdf.png; return the markdown.
    The plots show each configuration's median run."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", result)
    report = bench_markdown(result)
    (out / "results.md").write_text(report)
    canvas = [s for s in series if s.system.startswith("canvas")]
    baselines = {
        s.label: _median_run(s).output_tokens_per_s
        for s in series
        if not s.system.startswith("canvas")
    }
    plot_throughput([_median_run(s) for s in canvas], out / "throughput.png", baselines)
    cdf = [(s.label, s.runs[-1].records) for s in series if s.width == 1 or s in canvas]
    plot_latency_cdf(latency_series(cdf), out / "latency_cdf.png")
    return report
