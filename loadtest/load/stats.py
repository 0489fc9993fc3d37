"""Per-request records and their aggregates (pure Python: no numpy, no torch).

A `RequestRecord` is what one request measured; `summarize` turns the records of one run (one
concurrency level, one request rate, or one reference configuration) into a `RunSummary`.
Times are seconds from `time.perf_counter()`; percentiles interpolate linearly between ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request measured. `canvas_seconds` are the gaps between consecutive content
    chunks of the stream: each chunk is one committed canvas (one token in AR mode)."""

    index: int
    prompt_name: str
    start: float  # when it was sent, seconds after the run began
    latency: float  # to the end of the response (to the failure, for an error)
    ttft: float | None  # to the first chunk with content; None when nothing came
    canvas_seconds: tuple[float, ...]
    prompt_tokens: int | None
    output_tokens: int
    finish_reason: str | None
    steps_per_canvas: tuple[int, ...]  # from canvas_stats; empty when the server sent none
    decoder_passes: int | None
    tokens_per_forward: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean and percentiles of one quantity over a run; all None when nothing was measured."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, None, None, None, None)
        ordered = sorted(values)
        return cls(
            len(ordered),
            sum(ordered) / len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 90),
            percentile(ordered, 99),
        )


@dataclass(frozen=True, slots=True)
class EngineOverhead:
    """Engine time outside the model forward and the sampler's arithmetic over a run, from the
    server's step histograms."""

    num_steps: int
    step_seconds: float
    forward_seconds: float
    sample_seconds: float = 0.0
    # Steps run with each CPU thread count (`canvas:cpu_thread_steps`; `--threads auto`).
    thread_steps: dict[int, int] = field(default_factory=dict)

    @property
    def overhead_fraction(self) -> float | None:
        if self.step_seconds <= 0:
            return None
        busy = self.forward_seconds + self.sample_seconds
        return max(0.0, self.step_seconds - busy) / self.step_seconds

    @property
    def overhead_per_step(self) -> float | None:
        """Seconds per step outside the forward and the sampler."""
        if not self.num_steps:
            return None
        busy = self.forward_seconds + self.sample_seconds
        return max(0.0, self.step_seconds - busy) / self.num_steps

    @property
    def mean_step_ms(self) -> float | None:
        return 1e3 * self.step_seconds / self.num_steps if self.num_steps else None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Aggregates of one run. Throughputs count successful requests only, over the wall time
    from the first request sent to the last one finished."""

    label: str
    system: str  # "canvas" | "canvas-ar" | "reference" | "reference-batch" | a server's name
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    num_errors: int
    duration_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_s: Distribution
    latency_s: Distribution
    canvas_s: Distribution
    tpot_s: Distribution  # (latency - ttft) / (output tokens - 1), as `vllm bench serve` has it
    steps_per_canvas: float | None  # mean over committed canvases
    tokens_per_forward: float | None  # mean over requests
    error_examples: tuple[str, ...]
    engine_overhead: EngineOverhead | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, Distribution):
                value = {
                    "count": value.count,
                    "mean": value.mean,
                    "p50": value.p50,
                    "p90": value.p90,
                    "p99": value.p99,
                }
            elif isinstance(value, EngineOverhead):
                value = {
                    "num_steps": value.num_steps,
                    "step_seconds": value.step_seconds,
                    "forward_seconds": value.forward_seconds,
                    "sample_seconds": value.sample_seconds,
                    "mean_step_ms": value.mean_step_ms,
                    "overhead_fraction": value.overhead_fraction,
                    "thread_steps": {str(n): k for n, k in sorted(value.thread_steps.items())},
                }
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out


def percentile(ordered: Sequence[float], pct: float) -> float:
    """The `pct` percentile of an ascending, non-empty sequence (linear interpolation)."""
    assert ordered, "percentile of an empty sequence"
    rank = (len(ordered) - 1) * pct / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def gaps(times: Sequence[float]) -> tuple[float, ...]:
    """Differences between consecutive times (n times give n - 1 gaps)."""
    return tuple(later - earlier for earlier, later in zip(times, times[1:], strict=False))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    label: str,
    system: str,
    records: Sequence[RequestRecord],
    duration_s: float,
    concurrency: int | None = None,
    request_rate: float | None = None,
    engine_overhead: EngineOverhead | None = None,
) -> RunSummary:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.ttft is not None and r.output_tokens > 1
    ]
    steps = [s for r in ok for s in r.steps_per_canvas]
    tpf = [r.tokens_per_forward for r in ok if r.tokens_per_forward is not None]
    errors = list(dict.fromkeys(r.error for r in records if r.error is not None))
    return RunSummary(
        label=label,
        system=system,
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(records),
        num_errors=len(records) - len(ok),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        ttft_s=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        latency_s=Distribution.of([r.latency for r in ok]),
        canvas_s=Distribution.of([g for r in ok for g in r.canvas_seconds]),
        tpot_s=Distribution.of(tpot),
        steps_per_canvas=_mean(steps),
        tokens_per_forward=_mean(tpf),
        error_examples=tuple(errors[:3]),
        engine_overhead=engine_overhead,
    )
