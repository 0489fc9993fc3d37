"""Side-by-side benchmark: Canvas against the transformers reference, in one run.

    python -m loadtest.bench [--out bench-out] [--size full|toy] [flags]   (make bench)

Same checkpoint (the `bench-small` preset, built once into a cache directory), same prompts,
same token budgets, same fixed number of denoising steps, measured one after the other in this
process with the same torch thread count:

1. Canvas (in-process server, streaming OpenAI requests) at each --concurrency, diffusion mode,
   fast numerics (the default);
2. Canvas in AR mode at each --ar-concurrency;
3. Canvas with `--exact` numerics at each --exact-concurrency, diffusion mode;
4. the reference `generate()` one request at a time (the first --reference-requests prompts,
   the same ones, with the same seeds, as Canvas' concurrency-1 run) and in static batches.

It also measures this machine's fp32 GEMM rate and computes the FLOP floor of decoding the
checkpoint (`loadtest.floor`), so every diffusion throughput reads as a fraction of the floor.

Random weights never converge like a trained model's, so the adaptive stop is disabled and
every canvas runs exactly --denoising-steps steps (vLLM's published DiffusionGemma benchmark
also forces a fixed step count); EOS is ignored, so every request gets exactly --max-tokens.
Writes results.json, results.md, throughput.png and latency_cdf.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loadtest.bench_report import Measurements, assemble, write_bench_report
from loadtest.client import RequestSpec
from loadtest.floor import Floor, compute_floor
from loadtest.loadgen import Level, LevelResult, LoadConfig, make_client, run_level, warm_up
from loadtest.prompts import PROMPT_SETS, Prompt, make_prompts
from loadtest.stats import summarize

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
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    ar_concurrency: tuple[int, ...] = (16,)
    exact_concurrency: tuple[int, ...] = (1, 16)
    num_requests: int = 32  # per level above concurrency 1 (at least the concurrency)
    reference_requests: int = 8  # one at a time, and Canvas at concurrency 1
    static_batch: int = 16
    max_tokens: int = 128
    denoising_steps: int = 16
    prompt_set: str = "short-chat"
    warmup: int = 2
    threads: int = 2
    seed: int = 0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in (
            "num_requests",
            "reference_requests",
            "static_batch",
            "max_tokens",
            "denoising_steps",
            "threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        for name in ("ar_concurrency", "exact_concurrency"):
            levels = getattr(self, name)
            if levels and min(levels) < 1:
                raise ValueError(f"{name} levels must be >= 1, got {levels}")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"unknown prompt set {self.prompt_set!r}")
        from engine.testing import PRESETS  # light: the weights code imports torch lazily

        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}")

    def requests_at(self, concurrency: int) -> int:
        return self.reference_requests if concurrency == 1 else max(self.num_requests, concurrency)


# A few seconds on the CPU: the test's size, and a check that `make bench` works end to end.
TOY = {
    "preset": "c16",
    "concurrency": (1, 2),
    "ar_concurrency": (2,),
    "exact_concurrency": (1, 2),
    "num_requests": 2,
    "reference_requests": 2,
    "static_batch": 2,
    "max_tokens": 24,
    "denoising_steps": 2,
    "warmup": 1,
}


def checkpoint_for(config: BenchConfig) -> Path:
    """The preset's checkpoint in the cache, built on first use. The directory name carries a
    hash of the preset's definition, so a changed preset is rebuilt, never reused stale."""
    from engine.testing import PRESETS, make_tiny, preset_text_config

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


# run kind -> (decoding mode, the BenchConfig field with its levels, the system label)
RUN_KINDS = {
    "fast": ("diffusion", "concurrency", "canvas"),
    "ar": ("ar", "ar_concurrency", "canvas-ar"),
    "exact": ("diffusion", "exact_concurrency", "canvas-exact"),
}


async def _canvas_runs(
    config: BenchConfig, url: str, model: str, prompts: tuple[Prompt, ...], kind: str
) -> list[LevelResult]:
    """Warm up, then one closed-loop level per concurrency of a run kind (`RUN_KINDS`)."""
    mode, field, system = RUN_KINDS[kind]
    levels = getattr(config, field)
    if not levels:
        return []
    base = LoadConfig(
        url=url,
        spec=_canvas_spec(config, mode),
        model=model,
        prompts=prompts,
        warmup=config.warmup,
        system=system,
    )
    results = []
    async with make_client(base, max(levels) + 8) as client:
        await warm_up(client, base, model, max(levels))
        for c in levels:
            level_config = replace(base, num_requests=config.requests_at(c))
            results.append(await run_level(client, level_config, model, Level(concurrency=c)))
    return results


def _reference_runs(
    config: BenchConfig, checkpoint: Path, prompt_ids: list[tuple[str, list[int]]]
) -> tuple[LevelResult, LevelResult]:
    from loadtest import reference as ref

    model = ref.load_reference(checkpoint)
    settings = ref.ReferenceSettings(config.max_tokens, config.denoising_steps, config.seed)
    ref.warm_up(model, prompt_ids[0][1], settings)
    one, one_s = ref.run_one_at_a_time(model, prompt_ids[: config.reference_requests], settings)
    pad = model.generation_config.pad_token_id or 0
    batched, batched_s = ref.run_static_batches(
        model, prompt_ids[: config.num_requests], config.static_batch, settings, pad
    )
    label = f"reference static batch {config.static_batch}"
    results = (
        LevelResult(summarize("reference 1-at-a-time", "reference", one, one_s, 1), tuple(one)),
        LevelResult(summarize(label, "reference-batch", batched, batched_s), tuple(batched)),
    )
    for r in results:
        logger.info("%s: %.1f output tok/s", r.summary.label, r.summary.output_tokens_per_s)
    return results


def measure(config: BenchConfig, checkpoint: Path, prompts: tuple[Prompt, ...]) -> Measurements:
    """Canvas fast (diffusion, then AR), Canvas exact, then the reference: in sequence."""
    from engine.tokenizer import Tokenizer
    from loadtest.inprocess import serve_in_thread

    tokenizer = Tokenizer(checkpoint)  # the server's own tokenizer: the same prompt ids
    prompt_ids = [(p.name, tokenizer.apply_chat_template(p.chat_messages())) for p in prompts]
    widest = max((*config.concurrency, *config.ar_concurrency, *config.exact_concurrency))
    flags = ["--max-num-seqs", str(widest), "--dtype", "float32"]
    runs: dict[str, list[LevelResult]] = {}
    for server_flags, kinds in ((flags, ("fast", "ar")), ([*flags, "--exact"], ("exact",))):
        if not any(getattr(config, RUN_KINDS[k][1]) for k in kinds):
            continue
        with serve_in_thread(checkpoint, server_flags) as server:
            for kind in kinds:
                runs[kind] = asyncio.run(
                    _canvas_runs(config, server.url, server.model_name, prompts, kind)
                )
    reference_one, reference_batch = _reference_runs(config, checkpoint, prompt_ids)
    return Measurements(
        tuple(runs.get("fast", [])),
        tuple(runs.get("ar", [])),
        reference_one,
        reference_batch,
        tuple(runs.get("exact", [])),
    )


def run_bench(config: BenchConfig, command: str = "") -> dict[str, Any]:
    """Build (or reuse) the checkpoint, measure everything, write the reports into
    `config.out_dir`; return the JSON document."""
    import torch

    began = time.perf_counter()
    torch.set_num_threads(config.threads)
    checkpoint = checkpoint_for(config)
    num_prompts = max(config.num_requests, config.reference_requests, *config.concurrency)
    prompts = tuple(make_prompts(config.prompt_set, num_prompts, config.seed))
    floor = _floor(config, checkpoint, prompts)
    runs = measure(config, checkpoint, prompts)
    meta = _meta(config, checkpoint, num_prompts, command)
    meta["floor"] = floor.to_dict()
    result = assemble(meta, runs)
    meta["seconds"] = time.perf_counter() - began
    write_bench_report(config.out_dir, result, runs)
    return result


def _floor(config: BenchConfig, checkpoint: Path, prompts: tuple[Prompt, ...]) -> Floor:
    """The GEMM rate measured now and the FLOPs of the requests' canvases (prefix: a typical
    prompt plus half the output)."""
    from engine.model import load_model_config
    from engine.tokenizer import Tokenizer

    model_config = load_model_config(checkpoint)
    tokenizer = Tokenizer(checkpoint)
    lengths = [len(tokenizer.apply_chat_template(p.chat_messages())) for p in prompts]
    prefix = sum(lengths) // len(lengths) + config.max_tokens // 2
    canvas = model_config.canvas_length
    return compute_floor(model_config.text, canvas, prefix, config.denoising_steps, config.threads)


def _meta(config: BenchConfig, checkpoint: Path, num_prompts: int, command: str) -> dict:
    import torch

    from engine.testing import PRESETS, estimate_parameters, preset_text_config

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
        "requests_per_level": {str(c): config.requests_at(c) for c in config.concurrency},
        "ar_requests_per_level": {str(c): config.requests_at(c) for c in config.ar_concurrency},
        "reference_requests": config.reference_requests,
        "static_batch": config.static_batch,
        "static_batch_requests": min(config.num_requests, num_prompts),
        "warmup": config.warmup,
        "seed": config.seed,
        "torch_threads": config.threads,
        "torch_version": torch.__version__,
        "transformers_version": _version("transformers"),
        "hardware": _hardware(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _hardware() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--size",
        choices=["full", "toy"],
        default="full",
        help="toy: the c16 preset and a few requests (seconds); flags still override",
    )
    p.add_argument("--out", type=Path, default=None, help="output directory (bench-out)")
    p.add_argument("--cache-dir", type=Path, default=None, help="checkpoint cache")
    p.add_argument("--preset", default=None)
    p.add_argument("--concurrency", type=_ints, default=None, help="e.g. 1,4,16,64")
    p.add_argument("--ar-concurrency", type=_ints, default=None, help="'' to skip AR mode")
    p.add_argument(
        "--exact-concurrency", type=_ints, default=None, help="'' to skip exact numerics"
    )
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--reference-requests", type=int, default=None)
    p.add_argument("--static-batch", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--denoising-steps", type=int, default=None)
    p.add_argument("--prompt-set", choices=sorted(PROMPT_SETS), default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (2)")
    p.add_argument("--seed", type=int, default=None)
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    values: dict[str, Any] = dict(TOY) if args.size == "toy" else {}
    flags = {k: v for k, v in vars(args).items() if v is not None and k != "size"}
    if "out" in flags:
        flags["out_dir"] = flags.pop("out")
    values.update(flags)
    return BenchConfig(**values)


def configure_logging() -> None:
    """INFO progress lines, without a line per HTTP request (httpx, the server) or per load."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "server", "engine", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its markdown report. 0: no request failed."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    command = "python -m loadtest.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run_bench(config, command.strip())
    print((config.out_dir / "results.md").read_text())  # the report is this command's output
    logger.info("wrote %s in %.0f s", config.out_dir, result["meta"]["seconds"])
    return 0 if result["checks"]["num_errors"] == 0 else 1


if __name__ == "__main__":
    configure_logging()
    sys.exit(main())
