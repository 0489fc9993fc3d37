"""The benchmark's configuration (`BenchConfig`, the `--size` presets) and the configurations it
measures (`configurations`): Canvas fast, exact, overlapped and AR at each concurrency and the
reference beside them, in each of `BenchConfig.dtypes`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.cpu.bench_runs import Configuration, Shape, canvas_runner, reference_runner
from loadtest.load.client import RequestSpec
from loadtest.load.loadgen import LoadConfig
from loadtest.load.prompts import PROMPT_SETS, Prompt

if TYPE_CHECKING:
    from loadtest.load.inprocess import ServerHandle

# The dtypes the benchmark runs and the tag each one's labels carry: fp32's labels are the
# benchmark's original ones ("canvas c=16"), bf16's name it ("canvas bf16 c=16").
DTYPE_TAGS = {"float32": "", "bfloat16": " bf16"}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    out_dir: Path = Path("bench-out")
    cache_dir: Path | None = None  # None: $CANVAS_CACHE or ~/.cache/canvas, then /bench
    preset: str = "bench-small"
    concurrency: tuple[int, ...] = (1, 4, 16)
    ar_concurrency: tuple[int, ...] = (1, 16)
    exact_concurrency: tuple[int, ...] = (1, 16)
    # Canvas with `--overlap` (steps run ahead, `engine.device.overlap`) beside the serial loop
    overlap_concurrency: tuple[int, ...] = (16,)
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
    # Each Canvas configuration and reference run in each of these dtypes (`DTYPE_TAGS`).
    dtypes: tuple[str, ...] = ("float32", "bfloat16")

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
        for name in ("ar_concurrency", "exact_concurrency", "overlap_concurrency"):
            levels = getattr(self, name)
            if levels and min(levels) < 1:
                raise ValueError(f"{name} levels must be >= 1, got {levels}")
        if self.server not in ("subprocess", "thread"):
            raise ValueError(f"server must be 'subprocess' or 'thread', got {self.server!r}")
        if not self.dtypes or not set(self.dtypes) <= set(DTYPE_TAGS):
            raise ValueError(f"dtypes must be some of {', '.join(DTYPE_TAGS)}, got {self.dtypes}")
        if len(set(self.dtypes)) < len(self.dtypes):
            raise ValueError(f"dtypes must not repeat, got {self.dtypes}")
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
        "overlap_concurrency": (1, 16),
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
        "overlap_concurrency": (),  # its plumbing: tests/unit; a third server costs the test
        "num_requests": 2,
        "reference_requests": 2,
        "static_batch": 2,
        "max_tokens": 24,
        "denoising_steps": 2,
    },
}
SIZE_CHOICES = {"full": ("small", "tiny"), **{name: (name,) for name in SIZES}}


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
    "overlap": ("diffusion", "overlap_concurrency", "canvas-overlap"),
    "ar": ("ar", "ar_concurrency", "canvas-ar"),
}


def configurations(
    config: BenchConfig,
    servers: dict[tuple[str, str], ServerHandle],
    references: dict[str, Any],
    prompts: tuple[Prompt, ...],
    prompt_ids: list[tuple[str, list[int]]],
) -> list[Configuration]:
    """Every measured configuration, ordered so that each Canvas run sits next to the
    reference run it is compared with and to its twin in the other dtype: per mode, per width,
    Canvas fast, exact, then overlapped (each in every dtype of `config.dtypes`), then the
    reference in every dtype (one at a time at width 1, its static batch at `static_batch`).
    `servers`: the Canvas server of each (kind, dtype), kind "fast", "exact" or "overlap" (AR
    runs on "fast");
    `references`: the reference model of each dtype."""
    from loadtest.cpu.reference import ReferenceSettings

    settings = ReferenceSettings(config.max_tokens, config.denoising_steps, config.seed)
    out: list[Configuration] = []

    def add(label: str, system: str, mode: str, width: int, n: int, run: Any, dtype: str) -> None:
        steps = config.denoising_steps if mode == "diffusion" else 0
        names = tuple(p.name for p in prompts[: min(width, n)])
        shape = Shape(width, names, config.max_tokens, steps)
        out.append(Configuration(label, system, mode, width, n, shape, run, dtype))

    for mode, kinds in (("diffusion", ("fast", "exact", "overlap")), ("ar", ("ar",))):
        levels = {k: getattr(config, RUN_KINDS[k][1]) for k in kinds}
        if not any(levels.values()):
            continue
        prefix = "reference" if mode == "diffusion" else "reference-ar"
        for width in sorted({1, config.static_batch, *(c for v in levels.values() for c in v)}):
            for kind, dtype in ((k, d) for k in kinds if width in levels[k] for d in config.dtypes):
                system = RUN_KINDS[kind][2]
                server = servers["fast" if kind == "ar" else kind, dtype]
                base = LoadConfig(
                    url=server.url,
                    spec=_canvas_spec(config, mode),
                    model=server.model_name,
                    prompts=prompts,
                    system=system,
                )
                n, run = config.requests_at(width), canvas_runner(base, width)
                add(f"{system}{DTYPE_TAGS[dtype]} c={width}", system, mode, width, n, run, dtype)
            if width == 1:
                where, system, n = "1-at-a-time", prefix, config.reference_requests
            elif width == config.static_batch:
                where, system = f"static batch {width}", f"{prefix}-batch"
                n = max(config.num_requests, width)
            else:
                continue
            for dtype in config.dtypes:
                label = f"{prefix}{DTYPE_TAGS[dtype]} {where}"
                model = references[dtype]
                run = reference_runner(model, prompt_ids, width, settings, label, system, mode)
                add(label, system, mode, width, n, run, dtype)
    return out
