"""Warm-up before ready: the step loop runs throwaway requests of every decode mode before the
server says ready, so that the first step of each kind of row, which JIT-compiles its Triton
kernels (seconds each at the real shapes), never runs inline under traffic, where it would
stall the first requests and could outlast a liveness probe.

    warm_up(engine):  for each step size (`step_buckets`), for each mode: add its requests,
                      step until they end (at most ROUND_STEPS steps), abort what is left

Sizes: every integer that varies per step is left unspecialised and block sizes are fixed
(`kernels.triton_*`, checked by tests/kernels/test_specialisation.py), so a kernel compiles once
per constexpr set whatever the step's size. Two sizes then cover them: one request per mode, and
as many as one step runs; the largest also takes the step's peak memory before ready, and crosses
to 64-bit element counts where a launch's size needs them.

What it leaves behind: nothing a request or a metric sees. Its requests end (aborted when still
running), so their KV pages and sampler slots are free; the prefix cache forgets every page;
the scheduler forgets its step-cost fit, acceptance prior and prefix-cache counters
(`Scheduler.forget_history`); the async engine counts none of its steps and calls no step
listener (metrics). What stays is what it is for: compiled kernels (in memory and in
TRITON_CACHE_DIR, `triton_cache_dir`) and the allocator's pool grown to the largest step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoints.default import cache_dir
from engine.modes import mode_names
from engine.params import ParamError, SamplingParams
from engine.rows import ROW_KINDS
from kernels.support import interpreting

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)

# Steps per round (one mode, one size) besides its prompts': enough for each built-in mode to
# run each of its kinds (a canvas step, its commit or verify pass, an AR token); a round that
# has not ended by then (AR runs a token a step) is aborted.
ROUND_STEPS = 8
# An odd prompt length: no prefill is a size a kernel could be specialised on.
PROMPT_TOKENS = 37
# The throwaway requests' ids (no client's request is added while the step loop warms up: its
# commands wait in the loop's queue).
REQUEST_PREFIX = "canvas-warmup-"

Key = tuple[int, str]  # (requests per mode, row kind)


@dataclass(slots=True)
class WarmupReport:
    """What a warm-up ran: per (requests per mode, row kind) the rows, the steps that ran that
    kind and their seconds; in all, the steps, throwaway requests (and those that failed) and
    seconds."""

    rows: dict[Key, int] = field(default_factory=dict)
    steps: dict[Key, int] = field(default_factory=dict)
    seconds: dict[Key, float] = field(default_factory=dict)
    num_steps: int = 0
    num_requests: int = 0
    total_seconds: float = 0.0
    num_failed: int = 0

    def kinds(self) -> set[str]:
        return {kind for _, kind in self.rows}

    def record(self, bucket: int, row_kinds: dict[str, int], seconds: float) -> None:
        self.num_steps += 1
        for kind, count in row_kinds.items():
            key = (bucket, _name(kind))
            self.rows[key] = self.rows.get(key, 0) + count
            self.steps[key] = self.steps.get(key, 0) + 1
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds


def _name(kind: str) -> str:
    return kind.value if isinstance(kind, Enum) else kind


def wants_warmup(engine: Engine) -> bool:
    """`EngineConfig.warmup`, or where it is None (the default), whether the engine's kernels
    compile at first use: Triton's, compiled (not interpreted). The native CPU kernels build
    when the backend binds, at load, and the twins compile nothing: a CPU engine starts at
    once."""
    if engine.config.warmup is not None:
        return engine.config.warmup
    return engine.model.kernels.backend == "triton" and not interpreting()


def step_buckets(engine: Engine) -> tuple[int, ...]:
    """Requests per mode of each warm-up round: one, and as many as one step runs (the
    sequences that run at once, bounded by the canvases the token budget holds)."""
    sched = engine.scheduler.config
    canvases = max(1, sched.max_num_batched_tokens // engine.canvas_length)
    return tuple(sorted({1, min(sched.max_num_seqs, canvases)}))


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: $TRITON_CACHE_DIR where the user set it, else
    `triton/` under Canvas' cache directory (set in the environment here, before anything
    compiles), so a restarted server (and the Helm chart's pod, whose cache volume holds it)
    finds its kernels compiled instead of in ~/.triton."""
    chosen = os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
    return Path(chosen)


def warm_up(engine: Engine, should_stop: Callable[[], bool] = lambda: False) -> WarmupReport:
    """Run one step of every row kind at each size (`step_buckets`), logging a line per size and
    kind, and a total; return what ran. Call it on the thread that steps the engine, before
    any other request is added. A failure is logged and ends the warm-up (serving goes on:
    the first requests then compile what it did not); either way the engine is left as it
    was: no request, no cached prefix, no scheduler history. `should_stop`: checked before each
    step (shutdown)."""
    report = WarmupReport()
    began = time.perf_counter()
    buckets = step_buckets(engine)
    logger.info(
        "warm-up: compiling kernels before ready (%s requests per mode, modes %s)",
        " and ".join(map(str, buckets)),
        ", ".join(mode_names()),
    )
    try:
        for bucket in buckets:
            for mode in mode_names():
                if should_stop():
                    return report
                _round(engine, bucket, mode, report, should_stop)
            _log_bucket(report, bucket)
    except Exception:
        logger.exception("warm-up failed; serving without it (first requests may compile)")
    finally:
        for request_id in [r for r in engine.requests if r.startswith(REQUEST_PREFIX)]:
            engine.abort(request_id)
        engine.reset_prefix_cache()
        engine.scheduler.forget_history()
        report.total_seconds = time.perf_counter() - began
    missing = sorted(set(map(_name, ROW_KINDS)) - report.kinds())
    logger.info(
        "warm-up: done in %.1f s, %d steps, %d row kinds%s",
        report.total_seconds,
        report.num_steps,
        len(report.kinds()),
        f" (none ran: {', '.join(missing)})" if missing else "",
    )
    if report.num_failed:
        logger.warning("warm-up: %d throwaway requests failed (see above)", report.num_failed)
    return report


def _round(
    engine: Engine,
    bucket: int,
    mode: str,
    report: WarmupReport,
    should_stop: Callable[[], bool],
) -> None:
    """`bucket` throwaway requests of `mode`, stepped until they end or for ROUND_STEPS steps
    besides those their prompts take; those still running are aborted."""
    vocab, canvas = engine.model.cfg.vocab_size, engine.canvas_length
    engine.scheduler.forget_history()  # each round as a fresh server (hybrid drafts first)
    # A second canvas, so that the first is committed (diffusion) or verified (hybrid).
    params = SamplingParams(
        max_tokens=canvas + 1, mode=mode, seed=0, ignore_eos=True, max_denoising_steps=1
    )
    ids = []
    for i in range(bucket):
        request_id = f"{REQUEST_PREFIX}{bucket}-{mode}-{i}"
        first = report.num_requests * PROMPT_TOKENS  # distinct prompts: no shared prefix
        prompt = [(first + t) % vocab for t in range(PROMPT_TOKENS)]
        try:
            resolved = engine.validator.resolve(len(prompt), params)
            engine.add_request(request_id, prompt, resolved)
        except (ParamError, ValueError) as exc:
            logger.warning("warm-up: mode %s skipped: %s", mode, exc)
            break
        ids.append(request_id)
        report.num_requests += 1
    budget = engine.scheduler.config.max_num_batched_tokens
    for _ in range(ROUND_STEPS + -(-len(ids) * PROMPT_TOKENS // budget)):  # + the prompts' steps
        if should_stop() or not any(r in engine.requests for r in ids):
            break
        begin = time.perf_counter()
        result = engine.step()
        report.record(bucket, result.stats.row_kinds, time.perf_counter() - begin)
        report.num_failed += sum(1 for out in result.outputs if out.error)
    for request_id in ids:
        engine.abort(request_id)


def _log_bucket(report: WarmupReport, bucket: int) -> None:
    for (size, kind), rows in sorted(report.rows.items()):
        if size == bucket:
            key = (size, kind)
            logger.info(
                "warm-up: %d per mode, %-8s %4d rows in %3d steps, %.2f s",
                size,
                kind,
                rows,
                report.steps[key],
                report.seconds[key],
            )
