"""Side-by-side benchmark: Canvas against the transformers reference, in one run.

    python -m loadtest.cpu.bench [--out bench-out] [--size full|small|tiny|toy] [flags]
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

Every configuration is warmed at the shape it is timed at (--warmup runs of its first wave)
before anything is timed, then all are timed once per round for --repeats rounds, each Canvas
run next to its reference run; ratios are taken within a round and reported with their spread
(`loadtest.cpu.bench_runs`, `loadtest.cpu.bench_report`). Per step the report splits forward,
sampler and the rest. It also measures this machine's fp32 GEMM rate and computes the
checkpoint's FLOP floor (`loadtest.cpu.floor`), so every diffusion throughput reads as a
fraction of the floor.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.cpu.bench_report import assemble, write_bench_report
from loadtest.cpu.bench_runs import (
    Configuration,
    Ledger,
    Series,
    Shape,
    canvas_runner,
    reference_runner,
)
from loadtest.cpu.bench_runs import measure as run_configurations
from loadtest.cpu.floor import Floor, compute_floor, measure_gemm_rate
from loadtest.load.client import RequestSpec
from loadtest.load.loadgen import LoadConfig
from loadtest.load.prompts import PROMPT_SETS, Prompt, make_prompts
from loadtest.machine import comma_ints, hardware, package_version

if TYPE_CHECKING:
    from loadtest.load.inprocess import ServerHandle

logger = logging.getLogger(__name__)
NOTE = (
    "Random weights: the adaptive stop is disabled (confidence_threshold=0 in Canvas, an "
    "unreachable 1e-30 in the reference) and every canvas runs exactly {steps} denoising steps, "
    "as vLLM's published DiffusionGemma benchmark forces a fixed step count."
)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    out_dir: Path = Path("bench-out")
    cache_dir: Path | None = None  # None: $CANVAS_CACHE or ~/.cache/canvas, then /bench
    preset: str = "bench-small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    ar_concurrency: tuple[int, ...] = (1, 16)
    exact_concurrency: tuple[int, ...] = (1, 16)
    num_requests: int = 16  # per level above concurrency 1 (at least the concurrency)
    reference_requests: int = 4  # one at a time, and Canvas at concurrency 1
    static_batch: int = 16
    max_tokens: int = 128
    denoising_steps: int = 16
    prompt_set: str = "short-chat"
    warmup: int = 1  # warm-up runs of each configuration's first wave, before any timing
    repeats: int = 2  # timed rounds: every configuration once per round
    threads: int = 2  # the reference's torch threads (the benchmark's own process)
    # The Canvas servers' `--threads` (a count or "auto"); None: the server's default, "auto"
    # (every core but one, the other left to its HTTP front end and, here, the load generator,
    # measured per step against every core).
    server_threads: str | None = None
    seed: int = 0
    # "subprocess": each Canvas server in its own process (a sidecar, as deployed); "thread":
    # in this process, beside the load generator (their interpreter lock is shared).
    server: str = "subprocess"
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "num_requests",
            "reference_requests",
            "static_batch",
            "max_tokens",
            "denoising_steps",
            "threads",
            "warmup",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        threads = self.server_threads
        if threads is not None and threads != "auto" and not (threads.isdigit() and int(threads)):
            raise ValueError(f"server_threads must be 'auto' or a count >= 1, got {threads!r}")
        if self.repeats < 2:
            raise ValueError(f"repeats must be >= 2 (one run has no spread), got {self.repeats}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        for name in ("ar_concurrency", "exact_concurrency"):
            levels = getattr(self, name)
            if levels and min(levels) < 1:
                raise ValueError(f"{name} levels must be >= 1, got {levels}")
        if self.server not in ("subprocess", "thread"):
            raise ValueError(f"server must be 'subprocess' or 'thread', got {self.server!r}")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"unknown prompt set {self.prompt_set!r}")
        from engine.checkpoints.tiny import PRESETS  # light: the weights code imports torch lazily

        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}")

    def requests_at(self, concurrency: int) -> int:
        return self.reference_requests if concurrency == 1 else max(self.num_requests, concurrency)


# The checkpoints of `--size` (BenchConfig's defaults are `small`); `full` runs both of
# `make bench`, in this order. Flags override every size.
SIZES: dict[str, dict[str, Any]] = {
    "small": {},
    # Per-step costs dominate: 16 requests x 64 tokens, 8 steps; cheap, so five rounds (this
    # VM's speed swings by a third between minutes: three rounds' medians moved too much).
    "tiny": {
        "preset": "bench-tiny",
        "concurrency": (1, 16),
        "reference_requests": 8,
        "max_tokens": 64,
        "denoising_steps": 8,
        "repeats": 5,
    },
    # A few seconds: the test's size, and a check that `make bench` works end to end.
    "toy": {
        "preset": "c16",
        "concurrency": (1, 2),
        "ar_concurrency": (1, 2),
        "exact_concurrency": (1, 2),
        "num_requests": 2,
        "reference_requests": 2,
        "static_batch": 2,
        "max_tokens": 24,
        "denoising_steps": 2,
    },
}
SIZE_CHOICES = {"full": ("small", "tiny"), **{name: (name,) for name in SIZES}}


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


def _canvas_spec(config: BenchConfig, mode: str) -> RequestSpec:
    diffusion = mode == "diffusion"
    return RequestSpec(
        endpoint="chat",
        max_tokens=config.max_tokens,
        ignore_eos=True,
        mode=mode,
        max_denoising_steps=config.denoising_steps if diffusion else None,
        confidence_threshold=0.0 if diffusion else None,
        request_seed=config.seed,
        timeout_s=config.request_timeout_s,
    )


# Canvas run kind -> (decoding mode, the BenchConfig field with its levels, the system label)
RUN_KINDS = {
    "fast": ("diffusion", "concurrency", "canvas"),
    "exact": ("diffusion", "exact_concurrency", "canvas-exact"),
    "ar": ("ar", "ar_concurrency", "canvas-ar"),
}


def configurations(
    config: BenchConfig,
    servers: dict[str, ServerHandle],
    reference: Any,
    prompts: tuple[Prompt, ...],
    prompt_ids: list[tuple[str, list[int]]],
) -> list[Configuration]:
    """Every measured configuration, ordered so that each Canvas run sits next to the
    reference run it is compared with: per mode, per width, Canvas fast, exact, then the
    reference (one at a time at width 1, its static batch at `static_batch`)."""
    from loadtest.cpu.reference import ReferenceSettings

    settings = ReferenceSettings(config.max_tokens, config.denoising_steps, config.seed)
    out: list[Configuration] = []

    def add(label: str, system: str, mode: str, width: int, n: int, run: Any) -> None:
        steps = config.denoising_steps if mode == "diffusion" else 0
        names = tuple(p.name for p in prompts[: min(width, n)])
        shape = Shape(width, names, config.max_tokens, steps)
        out.append(Configuration(label, system, mode, width, n, shape, run))

    for mode, kinds in (("diffusion", ("fast", "exact")), ("ar", ("ar",))):
        levels = {k: getattr(config, RUN_KINDS[k][1]) for k in kinds}
        if not any(levels.values()):
            continue
        prefix = "reference" if mode == "diffusion" else "reference-ar"
        for width in sorted({1, config.static_batch, *(c for v in levels.values() for c in v)}):
            for kind in kinds:
                if width in levels[kind]:
                    system = RUN_KINDS[kind][2]
                    server = servers["exact" if kind == "exact" else "fast"]
                    base = LoadConfig(
                        url=server.url,
                        spec=_canvas_spec(config, mode),
                        model=server.model_name,
                        prompts=prompts,
                        system=system,
                    )
                    n = config.requests_at(width)
                    add(f"{system} c={width}", system, mode, width, n, canvas_runner(base, width))
            if width == 1:
                label, system, n = f"{prefix} 1-at-a-time", prefix, config.reference_requests
            elif width == config.static_batch:
                label, system = f"{prefix} static batch {width}", f"{prefix}-batch"
                n = max(config.num_requests, width)
            else:
                continue
            run = reference_runner(reference, prompt_ids, width, settings, label, system, mode)
            add(label, system, mode, width, n, run)
    return out


def measure(
    config: BenchConfig,
    checkpoint: Path,
    prompts: tuple[Prompt, ...],
    ledger: Ledger,
    each_round: Callable[[int], None] | None = None,
) -> list[Series]:
    """Both Canvas servers (fast, exact) and the reference up at once; every configuration
    warmed, then timed in rounds (`loadtest.cpu.bench_runs.measure`)."""
    from engine.inputs.tokenizer import Tokenizer
    from loadtest.cpu import reference as ref
    from loadtest.load.inprocess import serve_in_thread
    from loadtest.load.sidecar import serve_in_subprocesses

    tokenizer = Tokenizer(checkpoint)  # the server's own tokenizer: the same prompt ids
    prompt_ids = [(p.name, tokenizer.apply_chat_template(p.chat_messages())) for p in prompts]
    widest = max((*config.concurrency, *config.ar_concurrency, *config.exact_concurrency))
    # Warm-up and every round send the same prompts: a prefix cache would skip their prefill
    # from the second time on while the reference recomputes them, so the comparison runs
    # without one (`make bench-prefix` measures caching).
    flags = ["--max-num-seqs", str(widest), "--dtype", "float32", "--no-prefix-caching"]

    flag_sets = {"fast": flags}
    if config.exact_concurrency:
        flag_sets["exact"] = [*flags, "--exact"]
    with contextlib.ExitStack() as stack:
        if config.server == "thread":
            servers = {
                kind: stack.enter_context(serve_in_thread(checkpoint, server_flags))
                for kind, server_flags in flag_sets.items()
            }
        else:  # both start at once (each imports torch and loads the checkpoint)
            started = serve_in_subprocesses(
                checkpoint, list(flag_sets.values()), config.server_threads
            )
            servers = dict(zip(flag_sets, stack.enter_context(started), strict=True))
        reference = ref.load_reference(checkpoint)
        todo = configurations(config, servers, reference, prompts, prompt_ids)
        return run_configurations(todo, config.repeats, config.warmup, ledger, each_round)


def run_bench(config: BenchConfig, command: str = "") -> dict[str, Any]:
    """Build (or reuse) the checkpoint, measure everything, write the reports into
    `config.out_dir`; return the JSON document."""
    import torch

    began = time.perf_counter()
    torch.set_num_threads(config.threads)
    checkpoint = checkpoint_for(config)
    num_prompts = max(config.num_requests, config.reference_requests, config.static_batch)
    num_prompts = max(num_prompts, *config.concurrency, *config.ar_concurrency)
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
        "--server",
        choices=("subprocess", "thread"),
        default=None,
        help="each Canvas server in its own process (default, as deployed) or in this one",
    )
    return p


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
