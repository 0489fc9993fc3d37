"""The first run on a GPU machine (docs/gpu.md, "First run on a GPU"), stage by stage
(`STAGES`), each stage's result written and flushed as it ends (`<NN>_<stage>.json` in --out,
and `first_run.md` rewritten after each), so that a run cut short keeps what it found.

    make gpu-first-run GPU_OUT=dir                # on the GPU machine: 8 minutes, then gpu-check
    python3 -m loadtest.gpu.first_run --dry-run   # every stage's plumbing on CPU, toy shapes

Each stage has a time budget (an alarm ends it); a failure is recorded in its file and the next
stage runs. The launch, parity and attention stages use the real stack's first layers (through
its first full-attention layer), the profile the whole stack, both with random weights. The
dry run uses the benchmark's toy shapes, fp32 and the twins: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from engine.model import DiffusionLM
from kernels import resolve_kernels
from loadtest.gpu.bench import build_model, make_engine, model_config, run_round
from loadtest.gpu.kernel_timing import time_kernels
from loadtest.gpu.launch_probe import bound, busy, kernel_names, sync, timer, wrapped
from loadtest.gpu.roofline import with_layers

ROOT = Path(__file__).resolve().parents[2]
TOTAL_BUDGET_S = 480.0  # the measuring stages together (first compiles included)
# Stage budgets (seconds) on the GPU; the first stage that runs the model compiles its kernels.
# The check runs after the total, in its own budget (`make gpu-check`'s default).
BUDGETS = {
    "env": 15,
    "launch": 120,
    "pageable": 10,
    "parity": 90,
    "attention": 60,
    "load": 45,
    "profile": 120,
    "census": 10,
    "check": 540,
}
CHECK_COMMAND = [sys.executable, "-m", "loadtest.gpu.check"]
PREFIXES = (2048, 8192, 32768)
TOLERANCE = 2e-2  # bf16 parity: |fast - twin| <= TOLERANCE * (1 + |twin|)


class StageTimeout(Exception):
    """A stage ran past its budget."""


@dataclass
class Run:
    """One run's settings and the state stages share (the small model, built once)."""

    out: Path
    dry_run: bool
    device: torch.device
    dtype: torch.dtype
    backend: str
    canvases: int  # the parity and attention batch
    prompt_len: int
    prefixes: tuple[int, ...]
    load_bytes: int
    deadline: float
    summary: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the current stage's
    partial: dict[str, Any] = field(default_factory=dict)  # its results so far
    small: DiffusionLM | None = None

    def small_model(self) -> DiffusionLM:
        """The first layers of the stack through its first full layer (both attention kinds)."""
        if self.small is None:
            config = model_config(toy=self.dry_run)
            full = next(i for i, s in enumerate(config.text.layers) if not s.is_sliding)
            config = with_layers(config, full + 1)
            self.small = build_model(config, self.device, self.dtype, self.backend)
        return self.small


@contextmanager
def caught(run: Run, label: str = "") -> Iterator[None]:
    """Collect into `run.errors` (which fail the stage, after it ran) what the engine logs as
    failed inside the block: its fault isolation turns a kernel's exception into failed
    requests. With a `label`, an exception in the block is recorded too, and swallowed."""
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: run.errors.append(record.getMessage()[:300])  # type: ignore[method-assign]
    logging.getLogger("engine.engine").addHandler(handler)
    try:
        yield
    except Exception as exc:
        if not label:
            raise
        run.errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        logging.getLogger("engine.engine").removeHandler(handler)


def run_steps(run: Run, model: DiffusionLM, canvases: int, queued: bool = False) -> None:
    """`canvases` requests of one canvas, two denoising steps; `queued`: every forward queued
    behind a busy GPU (so that host timings measure launches, not a wait)."""
    engine = make_engine(model, canvases, run.prompt_len)
    inner = engine.runner.execute

    def execute(step: Any) -> Any:
        if queued:
            busy(run.device)
        return inner(step)

    engine.runner.execute = execute  # type: ignore[method-assign]
    forward: list[float] = [0.0]
    gen = torch.Generator().manual_seed(canvases)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (run.prompt_len,), generator=gen).tolist()] * canvases
    run_round(engine, prompts, 2, forward, "first-run")
    sync(run.device)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for f in fields(value) for t in _tensors(getattr(value, f.name))]
    return []


def _clone(value: Any) -> Any:
    """Inputs for the twin: tensors a kernel may write cloned (weights are only read)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return value


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (weights [N, K], ids [N, K]) with each token's experts in id order."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(-1, order), ids


def compare(fast: list[torch.Tensor], twin: list[torch.Tensor]) -> dict[str, float]:
    """Worst float error (relative to 1 + |twin|) and the share of integer values that differ."""
    worst, differ, count = 0.0, 0, 0
    for a, b in zip(fast, twin, strict=True):
        if a.is_floating_point():
            err = (a.float() - b.float()).abs() / (1 + b.float().abs())
            worst = max(worst, float(err.max()) if err.numel() else 0.0)
        else:
            differ += int((a != b).sum())
            count += a.numel()
    return {"max_rel_error": worst, "int_mismatch_share": differ / count if count else 0.0}


# -- the stages ---------------------------------------------------------------------------------


def stage_env(run: Run) -> dict[str, Any]:
    import triton  # noqa: F401 - its version, where it is installed

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "cpus": os.cpu_count(),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
    }
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        free, total = torch.cuda.mem_get_info(run.device)
        env |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}"}
        env |= {"sms": props.multi_processor_count, "free_gb": free / 1e9, "total_gb": total / 1e9}
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        done = subprocess.run(smi, capture_output=True, text=True, timeout=10, check=False)
        env["driver"] = done.stdout.strip() or done.stderr.strip()
    run.summary.append(
        f"env: torch {env['torch']}, triton {env['triton']}, {env.get('gpu', 'CPU')}"
    )
    return env


def stage_launch(run: Run) -> dict[str, Any]:
    """Host µs per call of each kernel the model has bound, over two engine steps."""
    model = run.small_model()
    ks = model.kernels
    seconds: dict[str, list[float]] = {}
    timed = timer(seconds)

    run_steps(run, model, 1)  # warm: every kernel compiled
    with bound(model, wrapped(ks, kernel_names(ks), timed)), caught(run):
        run_steps(run, model, 1, queued=True)
    per_call = {n: statistics.median(s) * 1e6 for n, s in seconds.items()}
    worst = max(per_call.items(), key=lambda kv: kv[1], default=("none", 0.0))
    run.summary.append(f"launch: slowest host call {worst[0]} {worst[1]:.1f} µs")
    return {"host_us_per_call": per_call, "calls": {n: len(s) for n, s in seconds.items()}}


def stage_pageable(run: Run) -> dict[str, Any]:
    """Host ms of a 256-byte non_blocking host-to-device copy queued behind a busy GPU."""
    out: dict[str, Any] = {}
    for kind in ("pageable", "pinned"):
        host = torch.zeros(64, dtype=torch.int32, pin_memory=kind == "pinned" and not run.dry_run)
        sync(run.device)
        busy(run.device)
        start = time.perf_counter()
        host.to(run.device, non_blocking=True)
        out[f"{kind}_ms"] = (time.perf_counter() - start) * 1e3
        sync(run.device)
    out["pageable_waits"] = out["pageable_ms"] > 10 * max(out["pinned_ms"], 0.01)
    run.summary.append(f"pageable: {out['pageable_ms']:.2f} ms vs pinned {out['pinned_ms']:.2f} ms")
    return out


def stage_parity(run: Run) -> dict[str, Any]:
    """Every kernel a step calls against its twin on clones of the same inputs (in-place
    kernels: the tensors they wrote), over two denoising steps of `run.canvases` canvases."""
    model = run.small_model()
    fast, twin = model.kernels, resolve_kernels(run.device.type, "twins")
    result: dict[str, dict[str, float]] = {}

    def shadowed(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            copies = _clone(list(args))
            out = fn(*args, **kwargs)
            mine = result.setdefault(
                name, {"calls": 0, "max_rel_error": 0.0, "int_mismatch_share": 0.0}
            )
            mine["calls"] += 1
            with caught(run, f"{name} against its twin"):
                ref = getattr(twin, name)(*copies, **kwargs)
                shown = out
                if name == "route_experts":  # bf16 ties order the chosen experts differently
                    shown, ref = by_expert(*out), by_expert(*ref)
                got = _tensors(shown) + (_tensors(list(args)) if out is None else [])
                want = _tensors(ref) + (_tensors(copies) if out is None else [])
                for key, value in compare(got, want).items():
                    mine[key] = max(mine[key], value)
            return out

        return call

    with bound(model, wrapped(fast, kernel_names(fast), shadowed)), caught(run):
        run_steps(run, model, run.canvases)
    bad = [n for n, r in result.items() if r["max_rel_error"] > TOLERANCE]
    run.errors += [f"{n}: off its twin by {result[n]['max_rel_error']:.3g} (relative)" for n in bad]
    run.summary.append(f"parity: {len(result)} kernels compared, over tolerance: {bad or 'none'}")
    return {"kernels": result, "tolerance": TOLERANCE, "over_tolerance": bad}


def stage_attention(run: Run) -> dict[str, Any]:
    model, out = run.small_model(), run.partial.setdefault("timings", [])
    for prefix in run.prefixes:
        timings = time_kernels(model, run.canvases, prefix, 1 if run.dry_run else 5, run.errors)
        for t in (t for t in timings if "attention" in t.name):
            gb_s = t.bytes / t.ms / 1e6
            out.append({"prefix": prefix, "kernel": t.name, "ms": t.ms, "gb_per_s": gb_s})
    run.summary.append(f"attention: {len(out)} timings at prefixes {list(run.prefixes)}")
    return {"canvases": run.canvases, "timings": out}


def stage_load(run: Run) -> dict[str, Any]:
    """A synthetic bf16 safetensors file of `run.load_bytes`, then each tensor to the device
    as the loader moves it (`.to(device, dtype)` from the memory-mapped file)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    per = min(run.load_bytes, 256 << 20) // 2
    tensors = {
        f"w{i}": torch.ones(per, dtype=torch.bfloat16) for i in range(run.load_bytes // (per * 2))
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(tensors, str(path))
        del tensors
        start = time.perf_counter()
        moved = 0
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is no mapping
                moved += f.get_tensor(key).to(run.device, torch.bfloat16).nbytes
        sync(run.device)
        seconds = time.perf_counter() - start
    run.summary.append(f"load: {moved / seconds / 1e9:.2f} GB/s")
    return {"bytes": moved, "seconds": seconds, "gb_per_s": moved / seconds / 1e9}


def stage_profile(run: Run) -> dict[str, Any]:
    """Chrome traces of two denoise steps at 1 and 16 canvases, the whole stack."""
    from torch.profiler import ProfilerActivity, profile

    run.small = None
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    model = build_model(model_config(run.dry_run), run.device, run.dtype, run.backend)
    cuda = run.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    out = run.partial  # a trace written before a timeout is kept
    for canvases in (1, 16):
        run_steps(run, model, canvases)  # warm: every kernel compiled
        with profile(activities=activities) as prof:
            run_steps(run, model, canvases)
        trace = run.out / f"trace_r{canvases}.json"
        prof.export_chrome_trace(str(trace))
        by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=by, row_limit=15)
        out[f"r{canvases}"] = {"trace": trace.name, "top": table.splitlines()}
    del model
    run.summary.append("profile: traces trace_r1.json, trace_r16.json")
    return out


def stage_census(run: Run) -> dict[str, Any]:
    """Triton kernels this process compiled (per @triton.jit function) and the cache's entries."""
    compiled: dict[str, int] = {}
    modules = [(n, m) for n, m in list(sys.modules.items()) if n.startswith("kernels.triton_")]
    for name, module in modules:
        for attr, obj in vars(module).items():
            jit = obj if hasattr(obj, "device_caches") else getattr(obj, "fn", None)  # autotuned
            caches = getattr(jit, "device_caches", None) or {}
            count = sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches.values())
            if count:
                compiled[f"{name.removeprefix('kernels.')}.{attr}"] = count
    cache = os.environ.get("TRITON_CACHE_DIR", "")
    entries = len(os.listdir(cache)) if cache and os.path.isdir(cache) else None
    run.summary.append(f"census: {sum(compiled.values())} compiled, cache entries {entries}")
    return {"compiled": compiled, "total": sum(compiled.values()), "cache_entries": entries}


def stage_check(run: Run) -> dict[str, Any]:
    """`make gpu-check` (`loadtest.gpu.check`) with the time left, its reports in check/."""
    budget = BUDGETS["check"] - 30  # the check's own reports are written inside its budget
    cmd = [*CHECK_COMMAND, "--out", str(run.out / "check"), "--budget-s", f"{budget:.0f}"]
    cmd += ["--dry-run"] if run.dry_run else []
    log = run.out / "check.log"
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    run.summary.append(f"check: rc {rc}")
    return {"command": " ".join(cmd), "rc": rc, "log": log.name}


STAGES: dict[str, Callable[[Run], dict[str, Any]]] = {
    "env": stage_env,
    "launch": stage_launch,
    "pageable": stage_pageable,
    "parity": stage_parity,
    "attention": stage_attention,
    "load": stage_load,
    "profile": stage_profile,
    "census": stage_census,
    "check": stage_check,
}


@contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in this (main) thread after `seconds`."""

    def expire(signum: int, frame: Any) -> None:
        raise StageTimeout(f"past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.1))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_stage(run: Run, number: int, name: str) -> bool:
    """Run one stage within its budget and write its file; False if it failed."""
    start, budget = time.monotonic(), BUDGETS[name] * (10 if run.dry_run else 1)
    if name != "check":  # the measuring stages share --budget-s
        budget = min(budget, max(run.deadline - start, 1.0))
    record = {"stage": name, "budget_s": budget}
    run.errors, run.partial = [], {}
    try:
        with alarm(budget):
            record["result"] = STAGES[name](run)
        record["ok"] = not run.errors  # errors recorded and carried on: not a clean run
    except Exception as exc:  # recorded; the next stage runs
        error = f"{type(exc).__name__}: {exc}"
        record |= {"ok": False, "error": error, "traceback": traceback.format_exc()}
        run.summary.append(f"{name}: FAILED ({error[:200]})")
    record["seconds"] = time.monotonic() - start
    record |= {"errors": run.errors} if run.errors else {}
    record |= {"partial": run.partial} if run.partial and not record["ok"] else {}
    text = json.dumps(record, indent=2, default=str)
    (run.out / f"{number:02d}_{name}.json").write_text(text + "\n")
    summary = "".join(f"- {line}\n" for line in run.summary)
    (run.out / "first_run.md").write_text(f"# First GPU run\n\n{summary}")
    state = "ok" if record["ok"] else "FAILED"
    print(f"== {name}: {state} in {record['seconds']:.1f} s", flush=True)
    return bool(record["ok"])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m loadtest.gpu.first_run", description=__doc__)
    p.add_argument("--out", type=Path, default=Path("gpu-results/first-run"), help="results")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy shapes, the twins")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="stages but check")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated, in order")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the stages; 0 when every one succeeded, 1 otherwise, 2 without a GPU or --dry-run."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("first_run: no CUDA GPU here; use --dry-run on CPU", file=sys.stderr)
        return 2
    unknown = set(args.stages.split(",")) - set(STAGES)
    if unknown:
        known = list(STAGES)
        print(f"first_run: --stages: unknown {sorted(unknown)}; known {known}", file=sys.stderr)
        return 2
    dry = args.dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(
        out=args.out,
        dry_run=dry,
        device=torch.device("cpu" if dry else "cuda"),
        dtype=torch.float32 if dry else torch.bfloat16,
        backend="twins" if dry else "auto",
        canvases=2 if dry else 16,
        prompt_len=8 if dry else 256,
        prefixes=(16, 32, 64) if dry else PREFIXES,
        load_bytes=(8 << 20) if dry else (4 << 30),
        deadline=time.monotonic() + args.budget_s,
    )
    results = [run_stage(run, i, name) for i, name in enumerate(args.stages.split(","))]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
