"""GPU benchmark of Canvas itself: the engine's own DiffusionGemma at the real 26B-A4B shapes.

    make gpu-bench                              # one H100/H200: real shapes, bf16, < 8 minutes
    python3 -m loadtest.gpu.bench --dry-run     # the same flow on CPU at a toy shape, seconds

No checkpoint: the engine's model (engine/model) is built on the meta device from the real
text config (engine.checkpoints.tiny REAL_26B_A4B_TEXT_CONFIG, the one source of the shapes), then
materialised on the GPU with random bf16 weights, and its kernel set is bound as `load_model`
binds it. Measured, in this order:

1. Ceilings: device-to-device copy bandwidth and the bf16 GEMM rate, measured here.
2. For each --canvases: an `Engine` running that many requests at once (a short prompt, one
   256-token canvas, exactly --steps denoising steps: confidence_threshold 0 disables the
   adaptive stop). After a warm-up round: the median engine step, the model forward inside it
   (synchronised), tokens/s at that fixed step count, the weight-streaming floor (all weight
   bytes at the measured copy bandwidth) as a share of the step, and peak GPU memory; then two
   more rounds stepped as the server steps them, nothing synchronised, serial and with steps
   run ahead (`--overlap`): the median time between two denoising steps' hand-overs of each.
3. Each bound kernel at that batch (canvas attention sliding/full, write_kv, route_experts,
   fused_moe, fused_sample, entropy_accept, soft_embedding, plus rms_norm and the LM head):
   time, achieved bytes/s and FLOP/s, each as a share of the measured ceilings.

Batch sizes that would end past --budget-s (estimated from the previous one) are skipped and
listed. Reports (JSON, markdown) are rewritten after every batch size, so a run cut short
leaves what it measured. The dry run uses fp32, a toy config with the real layer pattern and
the PyTorch twins (--backend triton: Triton's CPU interpreter, about a minute); its timings
mean nothing, it checks the flow.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.build import Checkpoint, build_engine
from engine.checkpoints.tiny import REAL_26B_A4B_CANVAS_LENGTH, REAL_26B_A4B_TEXT_CONFIG
from engine.device.overlap import StepPipeline
from engine.engine import Engine, EngineConfig
from engine.model import DiffusionLM, ModelConfig
from engine.model.config import parse_text_config
from engine.model.loader import BACKBONES
from engine.params import DecodingDefaults, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.types import RowKind
from kernels import BACKENDS
from loadtest.gpu.kernel_timing import Timer, measure_ceilings, recorded, time_kernels
from loadtest.gpu.report import BenchReport, EngineTiming, markdown, summary, write_reports

logger = logging.getLogger("gpu_bench")
RESULTS_DIR = Path("gpu-results")
# The dry run's toy shape: the real config with every size scaled down (2 layers: one sliding,
# one full with no v_proj and a double head_dim, as in the real stack).
TOY_TEXT_OVERRIDES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "sliding_window": 32,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
    "max_position_embeddings": 4096,
}
TOY_CANVAS_LENGTH = 16


@dataclass(frozen=True, slots=True)
class Settings:
    """One run's sizes."""

    dry_run: bool
    device: torch.device
    dtype: torch.dtype
    backend: str  # "auto" | "triton" | "twins"
    canvases: tuple[int, ...]
    steps: int  # denoising steps per canvas, fixed
    prompt_len: int
    prefix: int  # cached positions before each canvas in the kernel timings
    iters: int  # timed calls per kernel
    budget_s: float


# -- the model ---------------------------------------------------------------------------------


def model_config(toy: bool = False) -> ModelConfig:
    """The real 26B-A4B text stack (or the dry run's toy scaling of it) as Canvas parses it."""
    text = dict(REAL_26B_A4B_TEXT_CONFIG)
    if toy:
        text.update(TOY_TEXT_OVERRIDES)
    canvas = TOY_CANVAS_LENGTH if toy else REAL_26B_A4B_CANVAS_LENGTH
    return ModelConfig("diffusion_gemma", parse_text_config(text), canvas, "bfloat16")


def meta_model(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> DiffusionLM:
    """The engine's model on the meta device: shapes and sizes, no memory."""
    with torch.device("meta"):
        model = BACKBONES[config.model_type](config)
    return model.to(dtype)


def parameter_count(config: ModelConfig) -> int:
    return sum(p.numel() for p in meta_model(config).parameters())


def shape_summary(config: ModelConfig) -> dict[str, Any]:
    cfg = config.text
    full = [i for i, spec in enumerate(cfg.layers) if not spec.is_sliding]
    sliding, last = cfg.layers[0], cfg.layers[full[-1]]
    return {
        "layers": cfg.num_layers,
        "full_layers": full,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_heads,
        "sliding_kv_heads_x_dim": [sliding.num_kv_heads, sliding.head_dim],
        "full_kv_heads_x_dim": [last.num_kv_heads, last.head_dim],
        "window": cfg.sliding_window,
        "dense": cfg.intermediate_size,
        "experts": [cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size],
        "vocab": cfg.vocab_size,
        "canvas": config.canvas_length,
        "parameters": parameter_count(config),
    }


def build_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, backend: str, seed: int = 0
) -> DiffusionLM:
    """Meta → empty on `device` → random weights in place (matrices N(0, 0.02), norm weights,
    scales and layer scalars 1), then the kernel set bound, as `load_model` does after reading
    a checkpoint. Seconds even at 25B parameters on a GPU."""
    from kernels import resolve_kernels

    model = meta_model(config, dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
        for buffer in model.buffers():
            buffer.fill_(1.0)  # the per-mode layer scalars (the RoPE tables follow)
    model.init_rope(device)
    model.bind_kernels(resolve_kernels(device.type, backend, exact=False))
    return model.eval().requires_grad_(False)


def weight_bytes(model: DiffusionLM) -> int:
    """Bytes of every weight: what a step that touches every expert streams at least once."""
    return sum(p.nbytes for p in model.parameters())


# -- the engine step ---------------------------------------------------------------------------


def make_engine(model: DiffusionLM, canvases: int, prompt_len: int) -> Engine:
    """An engine sized for `canvases` requests of one canvas after `prompt_len` tokens."""
    length = model.config.canvas_length
    page = EngineConfig().page_size
    context = -(-(prompt_len + length) // page) * page
    sched = SchedulerConfig(
        max_num_seqs=canvases,
        max_num_batched_tokens=canvases * max(length, prompt_len),
        max_prefill_chunk=length,  # sizes the sliding-window ring: one canvas is the longest pass
    )
    config = EngineConfig(scheduler=sched, page_size=page, kv_cache_tokens=canvases * context)
    return build_engine(Checkpoint(model, None, DecodingDefaults()), config)


def instrument_forward(engine: Engine, timer: Timer) -> list[float]:
    """Time the runner's forward synchronised at both ends (its own clock does not wait for the
    GPU). The step's own clock needs no sync: it ends after the sampler's host transfer."""
    seconds: list[float] = []
    inner = engine.runner.execute

    def execute(step: Any) -> Any:
        timer.sync()
        start = time.perf_counter()
        out = inner(step)
        timer.sync()
        seconds.append(time.perf_counter() - start)
        return out

    engine.runner.execute = execute  # type: ignore[method-assign]
    return seconds


def add_requests(engine: Engine, prompts: list[list[int]], steps: int, tag: str) -> None:
    """`prompts` as requests of one canvas each, denoised exactly `steps` steps."""
    params = DecodingDefaults().resolve(
        SamplingParams(
            max_tokens=engine.canvas_length,
            seed=1,
            ignore_eos=True,
            max_denoising_steps=steps,
            confidence_threshold=0.0,
        )
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)


def run_round(
    engine: Engine, prompts: list[list[int]], steps: int, forward: list[float], tag: str
) -> tuple[list[tuple[int, int, float, float]], list[Any]]:
    """Run `prompts` (one canvas each, exactly `steps` steps) to completion. Returns per step
    (rows, tokens, step s, forward s) and the finished requests' stats."""
    add_requests(engine, prompts, steps, tag)
    records, finished = [], []
    limit = 2 * steps + 8  # prefill, the steps, slack
    for _ in range(limit):
        if not engine.has_work():
            break
        step = engine.step()
        outputs, last = step.outputs, step.stats
        records.append((last.num_rows, last.num_tokens, last.step_seconds, forward[-1]))
        finished += [o.stats for o in outputs if o.stats is not None]
    if engine.has_work():
        raise RuntimeError(f"{tag}: requests still running after {limit} steps")
    return records, finished


def step_period(
    engine: Engine, prompts: list[list[int]], steps: int, overlap: bool
) -> float | None:
    """The median wall time between the hand-overs of two steps that denoise every canvas,
    with `prompts` stepped as `AsyncEngine` steps them (`StepPipeline`; `overlap`: steps run
    ahead, `canvas serve --overlap`), nothing synchronised; None without two such steps."""
    handed: list[tuple[float, dict[str, int]]] = []
    pipeline = StepPipeline(
        engine, lambda r: handed.append((time.perf_counter(), r.stats.row_kinds)), overlap
    )
    add_requests(engine, prompts, steps, "overlap" if overlap else "serial")
    try:
        while engine.has_work() or pipeline.ahead:
            pipeline.step()
        pipeline.flush()
    finally:
        pipeline.close()
    every = {RowKind.DENOISE: len(prompts)}
    gaps = [
        t1 - t0
        for (t0, kinds0), (t1, kinds1) in zip(handed, handed[1:], strict=False)
        if kinds0 == every and kinds1 == every
    ]
    return statistics.median(gaps) if gaps else None


def time_engine(model: DiffusionLM, canvases: int, s: Settings, floor_s: float) -> EngineTiming:
    """A warm-up round (2 steps: every kernel compiled, both self-conditioning paths), then a
    timed round: `canvases` requests at once, `s.steps` steps each."""
    cfg, length, dev = model.cfg, model.config.canvas_length, s.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = make_engine(model, canvases, s.prompt_len)
    forward = instrument_forward(engine, Timer(dev, 1))
    gen = torch.Generator().manual_seed(canvases)
    prompts = [
        torch.randint(0, cfg.vocab_size, (s.prompt_len,), generator=gen).tolist()
        for _ in range(canvases)
    ]
    run_round(engine, prompts, min(2, s.steps), forward, "warmup")
    records, finished = run_round(engine, prompts, s.steps, forward, "timed")
    del engine.runner.execute  # the timer's closure holds the runner (and its syncs)
    periods = [step_period(engine, prompts, s.steps, overlap) for overlap in (False, True)]
    denoise = [r for r in records if r[:2] == (canvases, canvases * length)]
    # The round's first step runs the prompts (what the warm-up's prefix cache left of them)
    # and, in the same forward, each first canvas's first step (`first_step_along`).
    prefill = [r for r in records[:1] if r[:2] != (canvases, canvases * length)]
    if not denoise:
        raise RuntimeError(f"no step denoised all {canvases} canvases together: {records}")
    step = statistics.median(r[2] for r in denoise)
    return EngineTiming(
        canvases=canvases,
        step_ms=step * 1e3,
        step_ms_min=min(r[2] for r in denoise) * 1e3,
        forward_ms=statistics.median(r[3] for r in denoise) * 1e3,
        prefill_ms=prefill[0][2] * 1e3 if prefill else None,
        timed_steps=len(denoise),
        tokens_per_s=canvases * length / (s.steps * step),
        floor_share=floor_s / step,
        peak_memory_gb=torch.cuda.max_memory_allocated() / 1e9 if dev.type == "cuda" else None,
        steps_per_canvas=sorted({n for st in finished for n in st.steps_per_canvas}),
        serial_period_ms=None if periods[0] is None else periods[0] * 1e3,
        overlap_period_ms=None if periods[1] is None else periods[1] * 1e3,
    )


# -- the run -----------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _estimate_s(report: BenchReport, canvases: int, s: Settings, kernels_s: float) -> float:
    """Seconds the next batch size should take: steps scale at most linearly with canvases."""
    if not report.engine:
        return 0.0
    last = report.engine[-1]
    scale = max(1.0, canvases / last.canvases)
    return (3 * s.steps + 10) * last.step_ms / 1e3 * scale + kernels_s * scale + 5.0


def run(s: Settings, command: str, progress: Callable[[BenchReport], None]) -> BenchReport:
    """The whole benchmark; `progress` gets the report after each phase (to write it)."""
    began = time.monotonic()
    config = model_config(toy=s.dry_run)
    report = BenchReport(
        meta={
            "command": command,
            "dry_run": s.dry_run,
            "device": _device_name(s.device),
            "dtype": str(s.dtype).removeprefix("torch."),
            "backend": s.backend,
            "versions": _versions(),
            "shapes": shape_summary(config),
            "denoising_steps": s.steps,
            "prompt_len": s.prompt_len,
            "kernel_prefix": s.prefix,
        }
    )
    report.ceilings = measure_ceilings(Timer(s.device, s.iters), s.dtype, small=s.dry_run)
    model = build_model(config, s.device, s.dtype, s.backend)
    report.meta["weight_bytes"] = weight_bytes(model)
    report.meta["kernels"] = model.kernels.describe()
    floor_s = weight_bytes(model) / report.ceilings.copy_bytes_per_s
    report.floor_ms = floor_s * 1e3
    logger.info("model built (%s); %.1f s so far", report.meta["kernels"], time.monotonic() - began)
    kernels_s = 0.0
    for canvases in s.canvases:
        elapsed, estimate = time.monotonic() - began, _estimate_s(report, canvases, s, kernels_s)
        if elapsed + estimate > s.budget_s:
            report.skipped.append(
                f"{canvases} canvases: ~{estimate:.0f} s more after {elapsed:.0f} s exceeds "
                f"--budget-s {s.budget_s:.0f}"
            )
            continue
        with recorded(report.errors, f"engine step at {canvases} canvases"):
            report.engine.append(time_engine(model, canvases, s, floor_s))
        _release(s.device)
        start = time.monotonic()
        report.kernels += time_kernels(model, canvases, s.prefix, s.iters, report.errors)
        kernels_s = time.monotonic() - start
        _release(s.device)
        report.meta["seconds"] = time.monotonic() - began
        logger.info("%d canvases done; %.1f s so far", canvases, report.meta["seconds"])
        progress(report)
    report.meta["seconds"] = time.monotonic() - began
    return report


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- command line ------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,16; got {text!r}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="python3 -m loadtest.gpu.bench",
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="CPU, toy shape, fp32, seconds")
    p.add_argument("--canvases", type=_ints, help="batch sizes (default 1,4,16,64; dry 1,4)")
    p.add_argument("--steps", type=int, help="denoising steps per canvas (default 16; dry 2)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        help="kernel set (default: auto, Triton on CUDA; twins in a dry run)",
    )
    p.add_argument("--iters", type=int, help="timed calls per kernel (default 10; dry 1)")
    p.add_argument(
        "--prefix",
        type=int,
        help="cached positions before each canvas in the kernel timings (default 2048; dry 40)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=400.0,
        help="skip batch sizes that would end past this many seconds (400)",
    )
    p.add_argument("--json", type=Path, help=f"JSON report (default {RESULTS_DIR}/gpu_bench.json)")
    p.add_argument("--markdown", type=Path, help=f"markdown report ({RESULTS_DIR}/gpu_bench.md)")
    return p.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    dry = args.dry_run
    return Settings(
        dry_run=dry,
        device=torch.device("cpu" if dry else "cuda"),
        dtype=torch.float32 if dry else torch.bfloat16,
        backend=args.backend or ("twins" if dry else "auto"),
        canvases=args.canvases or ((1, 4) if dry else (1, 4, 16, 64)),
        steps=args.steps or (2 if dry else 16),
        prompt_len=8 if dry else 32,
        prefix=args.prefix or (40 if dry else 2048),
        iters=args.iters or (1 if dry else 10),
        budget_s=args.budget_s,
    )


def _dry_backend(backend: str) -> str:
    """A dry run's Triton kernels run in the CPU interpreter, which must be chosen before triton
    compiles anything; a process that already loaded triton without it gets the twins."""
    from kernels import triton_available

    if backend == "auto":
        backend = "triton" if triton_available() else "twins"
    if backend != "triton":
        return backend
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        logger.warning("triton is already loaded without its interpreter: timing the twins")
        return "twins"
    os.environ["TRITON_INTERPRET"] = "1"
    return backend


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, write its reports, print the markdown and then the summary.
    0: every timed canvas ran the fixed step count; 1: not; 2: no GPU without --dry-run."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA GPU here; use --dry-run to run the flow on CPU", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    s = settings_from_args(args)
    if s.dry_run:
        s = replace(s, backend=_dry_backend(s.backend))
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    name = "gpu_bench_dry_run" if s.dry_run else "gpu_bench"
    json_path = args.json or RESULTS_DIR / f"{name}.json"
    md_path = args.markdown or RESULTS_DIR / f"{name}.md"
    command = " ".join(["python3 -m loadtest.gpu.bench", *argv])
    report = run(s, command, lambda r: write_reports(r, json_path, md_path))
    write_reports(report, json_path, md_path)
    print(markdown(report))
    print(summary(report))
    print(f"  reports: {json_path}, {md_path}")
    return 0 if report.checks_pass() else 1


if __name__ == "__main__":
    sys.exit(main())
