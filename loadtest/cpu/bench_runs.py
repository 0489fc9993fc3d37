"""The benchmark's measured configurations, warmed and then timed in back-to-back rounds.

A configuration is one side of a comparison at one shape: Canvas through the server (fast or
exact numerics, diffusion or AR mode, one concurrency) or the transformers reference (diffusion
`generate()` or the greedy AR loop, one request at a time or a static batch). Every
configuration is warmed at the shape it is timed at (its first wave of requests: the same
prompts, the same batch width, budget and step count) before any is timed — transformers'
first batched `generate()` can cost 10x a later one — and then timed once per round, all
configurations in a fixed order, for `repeats` rounds. Neighbouring runs in a round are what a
ratio divides (this VM's speed drifts between minutes). The `Ledger` records every warm-up and
every timed run, so a test can check that nothing was timed cold.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadtest.load.loadgen import Level, LevelResult, LoadConfig, make_client, run_level
from loadtest.load.stats import summarize

logger = logging.getLogger(__name__)
WARMUP, TIMED = "warmup", "timed"


@dataclass(frozen=True, slots=True)
class Shape:
    """What a configuration computes per run: requests side by side, the first wave's prompts
    (by name), the token budget and the denoising steps (0 in AR mode)."""

    width: int
    prompts: tuple[str, ...]
    max_tokens: int
    denoising_steps: int


@dataclass(frozen=True, slots=True)
class Event:
    kind: str  # WARMUP | TIMED
    label: str  # the configuration
    shape: Shape
    round: int  # 0 for warm-ups; rounds count from 1


@dataclass(slots=True)
class Ledger:
    """Every warm-up and timed run, in the order they ran."""

    events: list[Event] = field(default_factory=list)

    def record(self, kind: str, label: str, shape: Shape, round_: int = 0) -> None:
        self.events.append(Event(kind, label, shape, round_))

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {
                "kind": e.kind,
                "label": e.label,
                "round": e.round,
                "shape": {
                    "width": e.shape.width,
                    "prompts": list(e.shape.prompts),
                    "max_tokens": e.shape.max_tokens,
                    "denoising_steps": e.shape.denoising_steps,
                },
            }
            for e in self.events
        ]


@dataclass(frozen=True, slots=True)
class Configuration:
    """One measured configuration. `run(n)` sends its first n requests (warm-up: one wave)."""

    label: str  # "canvas c=16", "reference static batch 16", ...
    system: str  # canvas | canvas-exact | canvas-ar | reference | reference-batch | reference-ar…
    mode: str  # diffusion | ar
    width: int  # concurrency, or requests per static batch
    num_requests: int
    shape: Shape
    run: Callable[[int], LevelResult]
    dtype: str = "float32"  # the weights' and activations' (Canvas and reference alike)

    @property
    def warmup_requests(self) -> int:
        return min(self.width, self.num_requests)


@dataclass(frozen=True, slots=True)
class Series:
    """A configuration's timed runs, one per round."""

    label: str
    system: str
    mode: str
    width: int
    runs: tuple[LevelResult, ...]
    dtype: str = "float32"


def measure(
    configurations: Sequence[Configuration],
    repeats: int,
    warmups: int,
    ledger: Ledger,
    each_round: Callable[[int], None] | None = None,
) -> list[Series]:
    """Warm every configuration `warmups` times at its shape, then `repeats` rounds that each
    time every configuration once, in order (`each_round(round)` first: the benchmark
    measures the machine's GEMM rate there, so that each round's floor is its own)."""
    for config in configurations:
        for _ in range(warmups):
            ledger.record(WARMUP, config.label, config.shape)
            config.run(config.warmup_requests)
    timed: dict[str, list[LevelResult]] = {c.label: [] for c in configurations}
    for round_ in range(1, repeats + 1):
        if each_round is not None:
            each_round(round_)
        for config in configurations:
            ledger.record(TIMED, config.label, config.shape, round_)
            result = config.run(config.num_requests)
            timed[config.label].append(result)
            tokens_per_s = result.summary.output_tokens_per_s
            logger.info("round %d %s: %.1f out tok/s", round_, config.label, tokens_per_s)
    return [
        Series(c.label, c.system, c.mode, c.width, tuple(timed[c.label]), c.dtype)
        for c in configurations
    ]


def canvas_runner(base: LoadConfig, concurrency: int) -> Callable[[int], LevelResult]:
    """Runs the first n requests of `base` at `concurrency` through the server, in a fresh
    client (and event loop) per run; the level's step breakdown comes from /metrics."""

    async def go(n: int) -> LevelResult:
        async with make_client(base, concurrency + 8) as client:
            config = replace(base, num_requests=n, warmup=0)
            return await run_level(client, config, base.model or "", Level(concurrency))

    return lambda n: asyncio.run(go(n))


def reference_runner(
    model: Any,
    prompts: Sequence[tuple[str, list[int]]],
    width: int,
    settings: Any,
    label: str,
    system: str,
    mode: str,
) -> Callable[[int], LevelResult]:
    """Runs the first n prompts through the reference, `width` at a time, in `mode`."""
    from loadtest.cpu import reference as ref

    pad = model.generation_config.pad_token_id or 0

    def go(n: int) -> LevelResult:
        records, wall, steps = ref.run_static_batches(
            model, prompts[:n], width, settings, pad, mode
        )
        concurrency = width if width == 1 else None
        summary = summarize(label, system, records, wall, concurrency, engine_overhead=steps)
        return LevelResult(summary, tuple(records))

    return go
