"""Side-by-side benchmark: Canvas against the transformers reference, in one run.

    python -m loadtest.cpu.bench [--out bench-out] [--size full|small|tiny|toy]
        [--dtypes float32,bfloat16] [flags]
    make bench

Two checkpoints (`--size full`, the default): `bench-small` (the real model's layer pattern
and MoE scaled to ~32M parameters: the GEMMs dominate) and `bench-tiny` (hidden 256, vocab 512,
canvas 32: a step's fixed costs dominate), each built once into a cache directory; reports in
--out/small and --out/tiny. Per checkpoint, the same prompts, token budgets and fixed number of
denoising steps, all in this process with the same torch thread count:

1. Canvas (in-process server, streaming OpenAI requests), fast numerics (the default) at each
   --concurrency and `--exact` numerics at each --exact-concurrency, diffusion mode, against the
   reference `generate()` one request at a time (the same prompts and seeds as Canvas' c=1) and
   in left-padded static batches of --static-batch;
2. Canvas AR mode at each --ar-concurrency against the reference's AR path (a greedy KV-cached
   loop over the same checkpoint's encoder and LM head) one at a time and in static batches.

Each of these runs in every dtype of --dtypes (fp32 and bf16 by default), Canvas and the reference
alike: bf16 against the reference in bf16, and each bf16 configuration next to its fp32 twin
in every round, the report dividing the two (bf16 / fp32; labels without a dtype are fp32's).

Every configuration is warmed at the shape it is timed at (--warmup runs of its first wave)
before anything is timed, then all are timed once per round for --repeats rounds, each Canvas
run next to its reference run; ratios are taken within a round and reported with their spread
(`loadtest.cpu.bench_runs`, `loadtest.cpu.bench_report`). Per step the report splits forward,
sampler and the rest. It also measures this machine's fp32 GEMM rate and computes the
checkpoint's FLOP floor (`loadtest.cpu.floor`), so every diffusion throughput reads as a
fraction of the floor (fp32's: the rate is an fp32 GEMM's).

Random weights never converge like a trained model's, so the adaptive stop is disabled and
every canvas runs exactly --denoising-steps steps (vLLM's published DiffusionGemma benchmark
also forces a fixed step count); EOS is ignored, so every request gets exactly --max-tokens.
Writes results.json, results.md, throughput.png and latency_cdf.png per checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.cpu.bench_config import SIZE_CHOICES, SIZES, BenchConfig, configurations
from loadtest.cpu.bench_report import assemble, write_bench_report
from loadtest.cpu.bench_runs import Ledger, Series
from loadtest.cpu.bench_runs import measure as run_configurations
from loadtest.cpu.floor import Floor, compute_floor, measure_gemm_rate
from loadtest.load.prompts import PROMPT_SETS, Prompt, make_prompts
from loadtest.machine import comma_ints, hardware, package_version

logger = logging.getLogger(__name__)
NOTE = (
    "Random weights: the adaptive stop is disabled (confidence_threshold=0 in Canvas, an "
    "unreachable 1e-30 in the reference) and every canvas runs exactly {steps} denoising steps, "
    "as vLLM's published DiffusionGemma benchmark forces a fixed step count."
)


def checkpoint_for(config: BenchConfig) -> Path:
    """The preset's checkpoint in the cache, built on first use. The directory name carries a
    hash of the preset's definition, so a changed preset is rebuilt, never reused stale."""
    from engine.checkpoints.tiny import PRESETS, make_tiny, preset_text_config

    spec = PRESETS[config.preset]
    definition = {"text": preset_text_config(config.preset), "preset": repr(spec)}
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()[:10]
    root = config.cache_dir or Path(os.environ.get("CANVAS_CACHE", Path.home() / ".cache/canvas"))
    path = root / "bench" / f"{config.preset}-seed{config.seed}-{digest}"
    if not (path / "config.json").is_file():
        logger.info("building the %s checkpoint into %s", config.preset, path)
        staging = path.with_name(f"{path.name}.tmp{os.getpid()}")
        make_tiny(staging, config.preset, seed=config.seed)
        shutil.rmtree(path, ignore_errors=True)
        staging.rename(path)
    return path


def measure(
    config: BenchConfig,
    checkpoint: Path,
    prompts: tuple[Prompt, ...],
    ledger: Ledger,
    each_round: Callable[[int], None] | None = None,
) -> list[Series]:
    """The Canvas servers (fast and exact, in each of `config.dtypes`) and the reference in each
    dtype up at once; every configuration warmed, then timed in rounds
    (`loadtest.cpu.bench_runs.measure`)."""
    from engine.inputs.tokenizer import Tokenizer
    from loadtest.cpu import reference as ref
    from loadtest.load.inprocess import serve_in_thread
    from loadtest.load.sidecar import serve_in_subprocesses

    tokenizer = Tokenizer(checkpoint)  # the server's own tokenizer: the same prompt ids
    prompt_ids = [(p.name, tokenizer.apply_chat_template(p.chat_messages())) for p in prompts]
    levels = (config.concurrency, config.ar_concurrency, config.exact_concurrency)
    widest = max(c for level in (*levels, config.overlap_concurrency) for c in level)
    # Warm-up and every round send the same prompts: a prefix cache would skip their prefill
    # from the second time on while the reference recomputes them, so the comparison runs
    # without one (`make bench-prefix` measures caching).
    flags = ["--max-num-seqs", str(widest), "--no-prefix-caching"]

    flag_sets = {}
    for dtype in config.dtypes:
        flag_sets["fast", dtype] = [*flags, "--dtype", dtype]
        if config.exact_concurrency:
            flag_sets["exact", dtype] = [*flags, "--dtype", dtype, "--exact"]
        if config.overlap_concurrency:
            flag_sets["overlap", dtype] = [*flags, "--dtype", dtype, "--overlap"]
    with contextlib.ExitStack() as stack:
        if config.server == "thread":
            servers = {
                key: stack.enter_context(serve_in_thread(checkpoint, server_flags))
                for key, server_flags in flag_sets.items()
            }
        else:  # all start at once (each imports torch and loads the checkpoint)
            started = serve_in_subprocesses(
                checkpoint, list(flag_sets.values()), config.server_threads
            )
            servers = dict(zip(flag_sets, stack.enter_context(started), strict=True))
        references = {dtype: ref.load_reference(checkpoint, dtype) for dtype in config.dtypes}
        todo = configurations(config, servers, references, prompts, prompt_ids)
        return run_configurations(todo, config.repeats, config.warmup, ledger, each_round)


def run_bench(config: BenchConfig, command: str = "") -> dict[str, Any]:
    """Build (or reuse) the checkpoint, measure everything, write the reports into
    `config.out_dir`; return the JSON document."""
    import torch

    began = time.perf_counter()
    torch.set_num_threads(config.threads)
    checkpoint = checkpoint_for(config)
    num_prompts = max(config.num_requests, config.reference_requests, config.static_batch)
    num_prompts = max(
        num_prompts, *config.concurrency, *config.ar_concurrency, *config.overlap_concurrency
    )
    prompts = tuple(make_prompts(config.prompt_set, num_prompts, config.seed))
    floor = _floor(config, checkpoint, prompts)
    ledger = Ledger()
    rates: list[float] = []

    def each_round(_: int) -> None:  # the GEMM rate of this round, for its own floor
        rates.append(measure_gemm_rate(hidden, threads=config.threads))

    hidden = floor_hidden(checkpoint)
    series = measure(config, checkpoint, prompts, ledger, each_round)
    meta = _meta(config, checkpoint, num_prompts, command)
    meta["floor"] = floor.with_round_rates(rates).to_dict()
    result = assemble(meta, series, ledger.to_json())
    meta["seconds"] = time.perf_counter() - began
    write_bench_report(config.out_dir, result, series)
    return result


def floor_hidden(checkpoint: Path) -> int:
    """The hidden size the floor's GEMM rate is measured at."""
    from engine.model import load_model_config

    return load_model_config(checkpoint).text.hidden_size


def _floor(config: BenchConfig, checkpoint: Path, prompts: tuple[Prompt, ...]) -> Floor:
    """The GEMM rate measured now and the FLOPs of the requests' canvases (prefix: a typical
    prompt plus half the output) and of their prompts' prefill (the mean prompt)."""
    from engine.inputs.tokenizer import Tokenizer
    from engine.model import load_model_config

    model_config = load_model_config(checkpoint)
    tokenizer = Tokenizer(checkpoint)
    lengths = [len(tokenizer.apply_chat_template(p.chat_messages())) for p in prompts]
    prompt = sum(lengths) // len(lengths)
    canvas = model_config.canvas_length
    per_request = -(-config.max_tokens // canvas)
    return compute_floor(
        model_config.text,
        canvas,
        prompt + config.max_tokens // 2,
        config.denoising_steps,
        config.threads,
        prompt=prompt,
        canvases_per_request=per_request,
    )


def _meta(config: BenchConfig, checkpoint: Path, num_prompts: int, command: str) -> dict:
    import torch

    from engine.checkpoints.tiny import PRESETS, estimate_parameters, preset_text_config

    params = estimate_parameters(preset_text_config(config.preset))
    return {
        "command": command,
        "preset": config.preset,
        "checkpoint": str(checkpoint),
        "checkpoint_description": PRESETS[config.preset].description,
        "parameters": {"total": params.total, "active": params.active},
        "canvas_length": PRESETS[config.preset].canvas_length,
        "max_tokens": config.max_tokens,
        "denoising_steps": config.denoising_steps,
        "adaptive_stop": False,
        "note": NOTE.format(steps=config.denoising_steps),
        "prompt_set": config.prompt_set,
        "num_prompts": num_prompts,
        "concurrency": list(config.concurrency),
        "ar_concurrency": list(config.ar_concurrency),
        "exact_concurrency": list(config.exact_concurrency),
        "overlap_concurrency": list(config.overlap_concurrency),
        "reference_requests": config.reference_requests,
        "static_batch": config.static_batch,
        "warmup": config.warmup,
        "repeats": config.repeats,
        "seed": config.seed,
        "torch_threads": config.threads,
        "canvas_server": config.server,
        "canvas_server_threads": _server_threads(config),
        "torch_version": torch.__version__,
        "transformers_version": package_version("transformers"),
        "hardware": hardware(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }


def _server_threads(config: BenchConfig) -> str:
    """The CPU threads of the Canvas servers, in the banner's words: `--server-threads`, else a
    sidecar's default (`canvas serve` without OMP_NUM_THREADS: auto); in-process servers
    follow this process's OMP_NUM_THREADS, as `canvas serve` does."""
    from engine.cpu_threads import choose_threads, describe_threads

    saved = os.environ.pop("OMP_NUM_THREADS", None) if config.server == "subprocess" else None
    try:
        return describe_threads(choose_threads(config.server_threads))
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.cpu.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size",
        choices=sorted(SIZE_CHOICES),
        default="full",
        help="full: the small and the tiny checkpoint (make bench); toy: the c16 preset and a "
        "few requests (seconds); flags override every size",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (bench-out)")
    p.add_argument("--cache-dir", type=Path, default=None, help="checkpoint cache")
    p.add_argument("--preset", default=None)
    p.add_argument("--concurrency", type=comma_ints, default=None, help="e.g. 1,4,16,64")
    p.add_argument("--ar-concurrency", type=comma_ints, default=None, help="'' to skip AR mode")
    p.add_argument(
        "--exact-concurrency", type=comma_ints, default=None, help="'' to skip exact numerics"
    )
    p.add_argument(
        "--overlap-concurrency", type=comma_ints, default=None, help="'' to skip --overlap"
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--reference-requests", type=int, default=None)
    p.add_argument("--static-batch", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--denoising-steps", type=int, default=None)
    p.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default=None)
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per configuration")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (>= 2)")
    p.add_argument("--threads", type=int, default=None, help="the reference's torch threads (2)")
    p.add_argument(
        "--server-threads",
        default=None,
        help="the Canvas servers' --threads: a count or 'auto' (default: the server's own, auto)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--dtypes",
        type=comma_names,
        default=None,
        help="the dtypes every configuration runs in, Canvas and reference alike "
        "(default: float32,bfloat16; the report divides bf16 by fp32)",
    )
    p.add_argument(
        "--server",
        choices=("subprocess", "thread"),
        default=None,
        help="each Canvas server in its own process (default, as deployed) or in this one",
    )
    return p


def comma_names(text: str) -> tuple[str, ...]:
    """argparse type: "float32,bfloat16" -> ("float32", "bfloat16")."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def configs_from_args(args: argparse.Namespace) -> list[BenchConfig]:
    """One config per checkpoint of `--size`, each writing into --out/<size>."""
    flags = {k: v for k, v in vars(args).items() if v is not None and k not in ("size", "out")}
    out = args.out or Path("bench-out")
    return [
        BenchConfig(**{**SIZES[size], **flags, "out_dir": out / size})
        for size in SIZE_CHOICES[args.size]
    ]


def configure_logging() -> None:
    """INFO progress lines, without a line per HTTP request (httpx, the server) or per load."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "server", "engine", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark of each checkpoint and print its markdown report. 0: no request
    failed."""
    args = build_parser().parse_args(argv)
    try:
        configs = configs_from_args(args)
    except (ValueError, TypeError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    command = "python -m loadtest.cpu.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    errors = 0
    for config in configs:
        result = run_bench(config, command.strip())
        print((config.out_dir / "results.md").read_text())  # the report is this command's output
        logger.info("wrote %s in %.0f s", config.out_dir, result["meta"]["seconds"])
        errors += result["checks"]["num_errors"]
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    configure_logging()
    sys.exit(main())
