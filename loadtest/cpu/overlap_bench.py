"""Overlapped steps (`engine.device.overlap`, `canvas serve --overlap`) and the engine in a
process of its own (`engine.process`, `canvas serve --engine-process`) against serial steps in
this process: how much of the engine's overhead hides behind the forward, and what that gives
end to end.

    python -m loadtest.cpu.overlap_bench [--preset bench-tiny] [--repeats 5] [--out FILE]
        [--modes serial,overlap,process] [--concurrency 1,16]

One engine per mode over one checkpoint: `AsyncEngine`s in this process, serial (the
default) and overlapped, and a `RemoteEngine` whose step loop runs in a spawned process.
Each request is streamed to a client coroutine on this event loop that detokenizes its text
so far at every output, as the HTTP front end does (so an in-process step loop shares the
interpreter lock with a front end, without sockets; the engine process's does not). `make
bench`'s `bench-tiny` workload: diffusion mode, a fixed number of denoising steps (random
weights never converge), EOS ignored, fast numerics, the model's operators on one torch
thread (`canvas serve --threads auto` on this 2-core VM: every core but one).

Per round, at each concurrency, the engines run the same requests back to back (their order
reversed every other round); ratios are taken within a round, each mode's against serial. Per
step:

- cycle: the wall time between two consecutive steps' hand-overs (`on_step`; the engine
  process's arrive here one message per step), over steps that ran the same rows as the step
  before (all canvases mid-denoising), median;
- overhead: the serial cycle minus its forward and sampler (`StepStats`), i.e. everything the
  step loop does besides them: scheduling, inputs, the update, outputs, metrics, publishing,
  and waiting for the interpreter lock;
- hidden: (serial cycle - the mode's cycle) / serial overhead, the share of the overhead that
  the mode's loop no longer spends between two forwards; and 1 - the mode's overhead / serial
  overhead, the same share measured within each step (the machine's speed drifts between runs
  by more than the overhead: the first compares two runs' cycles, the second each step's
  cycle with its own forward and sampler);
- per wave: the engine time outside forward and sampler summed over every step of the wave
  (`StepStats.step_seconds` minus both, as `make bench` takes it from the server's histograms:
  the admission and commit steps included), and the share of the serial wave's that the mode
  hides.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.cpu.bench import SIZES, BenchConfig, checkpoint_for, configure_logging
from loadtest.load.prompts import make_prompts

logger = logging.getLogger(__name__)
MODES = ("serial", "overlap", "process")


@dataclass(slots=True)
class Run:
    """One engine's run of a wave of requests."""

    seconds: float = 0.0
    tokens: int = 0
    steps: list[tuple[float, Any]] = field(default_factory=list)  # (hand-over time, stats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def steady(self) -> list[tuple[float, float]]:
        """(cycle, forward + sampler) of each step that ran the rows the step before ran."""
        out = []
        for (t0, before), (t1, stats) in zip(self.steps, self.steps[1:], strict=False):
            same = stats.row_kinds == before.row_kinds and len(stats.row_kinds) == 1
            if same and "denoise" in stats.row_kinds:
                out.append((t1 - t0, stats.forward_seconds + stats.sample_seconds))
        return out


def split(run: Run) -> dict[str, float] | None:
    """Medians (ms) over a run's steady steps of the cycle, the forward + sampler, and the
    overhead (each step's cycle minus its own forward and sampler); and the run's engine time
    outside the forward and sampler over all its steps, as `make bench` counts it from the
    step statistics (`wave_overhead_ms`: the admission and commit steps too)."""
    steady = run.steady()
    if not steady:
        return None
    outside = [s.step_seconds - s.forward_seconds - s.sample_seconds for _, s in run.steps]
    return {
        "steps": len(steady),
        "cycle_ms": 1e3 * statistics.median(c for c, _ in steady),
        "busy_ms": 1e3 * statistics.median(b for _, b in steady),
        "overhead_ms": 1e3 * statistics.median(c - b for c, b in steady),
        "wave_overhead_ms": 1e3 * sum(max(0.0, x) for x in outside),
    }


def hidden_shares(serial: dict[str, float], overlapped: dict[str, float]) -> dict[str, float]:
    """`cycles`: (serial cycle - overlapped cycle) / serial overhead; `overheads`: 1 -
    overlapped overhead / serial overhead, the same share when overlap leaves the forward and
    sampler alone, and robust to the machine's speed changing between the two runs; `waves`:
    1 - the overlapped wave's engine time outside forward and sampler / the serial one's."""
    return {
        "cycles": (serial["cycle_ms"] - overlapped["cycle_ms"]) / serial["overhead_ms"],
        "overheads": 1 - overlapped["overhead_ms"] / serial["overhead_ms"],
        "waves": 1 - overlapped["wave_overhead_ms"] / serial["wave_overhead_ms"],
    }


async def wave(
    engine: Any, tokenizer: Any, requests: list[tuple[list[int], Any]], width: int
) -> Run:
    """Every request through `engine`, `width` at a time, each streamed and detokenized."""
    run = Run()
    listener = lambda stats, outputs: run.steps.append((time.perf_counter(), stats))  # noqa: E731
    engine.on_step.append(listener)
    gate = asyncio.Semaphore(width)

    async def one(i: int, prompt: list[int], params: Any) -> int:
        async with gate:
            ids: list[int] = []
            async for out in engine.generate(f"r{time.monotonic_ns()}-{i}", prompt, params):
                ids += out.new_token_ids
                tokenizer.decode(ids)  # the front end's text so far
            return len(ids)

    began = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))
    run.seconds, run.tokens = time.perf_counter() - began, sum(counts)
    engine.on_step.remove(listener)
    return run


def start_engines(checkpoint: Path, modes: Sequence[str]) -> tuple[dict[str, Any], Any]:
    """One started engine per mode ("serial" first: its engine validates the requests) and
    the tokenizer; torch on one thread everywhere."""
    from engine.async_engine import AsyncEngine
    from engine.build import BuildConfig, CheckpointConfig
    from engine.cpu_threads import one_thread
    from engine.engine import EngineConfig
    from engine.llm import LLM
    from engine.process.client import RemoteEngine
    from engine.process.core import EngineSpec

    loop = asyncio.get_running_loop()
    engines: dict[str, Any] = {}
    tokenizer = None
    for mode in ("serial", *(m for m in modes if m != "serial")):
        engine_config = EngineConfig(prefix_caching=False, overlap=mode == "overlap")
        if mode == "process":
            remote = BuildConfig(
                CheckpointConfig(checkpoint, "float32", "cpu"),
                dataclasses.replace(engine_config, cpu_threads=(1,)),
            )
            engines[mode] = RemoteEngine(EngineSpec(remote, warmup=False, setup=one_thread))
        else:
            llm = LLM.from_pretrained(checkpoint, dtype="float32", config=engine_config)
            engines[mode] = AsyncEngine(llm.engine, warmup=False)
            tokenizer = tokenizer or llm.tokenizer
        engines[mode].start(loop)
    return engines, tokenizer


async def measure(
    preset: str, repeats: int, widths: Sequence[int], modes: Sequence[str] = MODES
) -> dict[str, Any]:
    import torch

    from engine.params import SamplingParams

    config = BenchConfig(**{**SIZES["tiny"], "preset": preset})  # `make bench`'s workload
    torch.set_num_threads(1)
    checkpoint = checkpoint_for(config)
    engines, tokenizer = start_engines(checkpoint, modes)
    modes = tuple(engines)
    assert tokenizer is not None
    prompts = make_prompts(config.prompt_set, max(widths), config.seed)
    params = SamplingParams(
        max_tokens=config.max_tokens,
        max_denoising_steps=config.denoising_steps,
        confidence_threshold=0.0,
        ignore_eos=True,
        seed=config.seed,
    )
    validator = engines["serial"].engine.validator
    ids = [tokenizer.apply_chat_template(p.chat_messages()) for p in prompts]
    requests = [(i, validator.validate(i, params)) for i in ids]
    for mode in modes:  # warm-up: each engine at each width
        for width in widths:
            await wave(engines[mode], tokenizer, requests[:width], width)
    rounds = []
    for round_ in range(repeats):
        order = modes if round_ % 2 == 0 else modes[::-1]
        result: dict[str, Any] = {}
        for width in widths:
            runs = {
                mode: await wave(engines[mode], tokenizer, requests[:width], width)
                for mode in order
            }
            result[f"c={width}"] = entry = compare(runs)
            logger.info("round %d c=%d: %s", round_ + 1, width, json.dumps(entry, default=_r))
        rounds.append(result)
    for engine in engines.values():
        engine.shutdown()
    summary = summarize(rounds, widths, modes)
    return {"preset": preset, "load": os.getloadavg(), "rounds": rounds, "summary": summary}


def compare(runs: dict[str, Run]) -> dict[str, Any]:
    """One round at one width: each mode's tok/s and step split; each other mode's speedup
    and hidden shares against serial."""
    splits = {mode: split(run) for mode, run in runs.items()}
    entry: dict[str, Any] = {
        mode: {"tok_s": run.tokens_per_s, "split": splits[mode]} for mode, run in runs.items()
    }
    serial = splits["serial"]
    for mode in runs.keys() - {"serial"}:
        entry[mode]["speedup"] = runs[mode].tokens_per_s / runs["serial"].tokens_per_s
        if serial and (ours := splits[mode]):
            entry[mode]["hidden"] = hidden_shares(serial, ours)
    return entry


def summarize(
    rounds: list[dict[str, Any]], widths: Sequence[int], modes: Sequence[str]
) -> dict[str, Any]:
    """Per width: median [min, max] over rounds of each mode's tok/s and step split, and of
    each other mode's speedup and hidden shares against serial."""

    def spread(values: list[float]) -> list[float]:
        return [statistics.median(values), min(values), max(values)] if values else []

    out: dict[str, Any] = {}
    for width in widths:
        key = f"c={width}"
        entries = [r[key] for r in rounds]
        others = [m for m in modes if m != "serial"]
        out[key] = {
            **{f"{m}_tok_s": spread([e[m]["tok_s"] for e in entries]) for m in modes},
            **{f"{m}_speedup": spread([e[m]["speedup"] for e in entries]) for m in others},
            **{
                f"{m}_hidden_by_{k}": spread(
                    [e[m]["hidden"][k] for e in entries if "hidden" in e[m]]
                )
                for m in others
                for k in ("cycles", "overheads", "waves")
            },
            **{
                f"{m}_{k}": spread([e[m]["split"][k] for e in entries if e[m]["split"]])
                for m in modes
                for k in ("cycle_ms", "busy_ms", "overhead_ms", "wave_overhead_ms")
            },
        }
    return out


def _r(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="bench-tiny")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated widths")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.concurrency.split(",")]
    modes = args.modes.split(",")
    if args.repeats < 2 or min(widths) < 1:
        parser.error("--repeats must be >= 2 and every --concurrency level >= 1")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))} (choose from {MODES})")
    configure_logging()
    result = asyncio.run(measure(args.preset, args.repeats, widths, modes))
    text = json.dumps(result, indent=1, default=_r)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps(result["summary"], indent=1, default=_r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
