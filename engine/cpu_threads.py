"""The CPU thread count of each engine step, chosen by measuring steps (`ThreadTuner`).

A CPU operator runs as an OpenMP region whose threads wait for each other at its end. Where a
step's operators are small (a small model, a step of a few tokens) a second thread costs more
in hand-offs than it adds, and when the HTTP front end or a client on the same machine takes a
core from one of the threads, the whole region waits for it. Where the GEMMs are large every
core pays, stalls included. Which side wins depends on the model, the step's size and what
else runs on the machine (measured on a 2-core VM, sidecar server and load generator on the
same cores: a 7M-parameter model served 1.6-2.6x the tokens/s on one thread, a 32M one up to
1.6x more on two at 16 canvases per step). So the engine measures it: steps are grouped by
their token count (half-octave buckets); in each bucket every candidate count runs a few steps
in turn (or, next to a bucket that has chosen, that choice runs and the others are tried every
few steps), then the count with the lowest median step time runs, and every `probe_every`-th
step of the bucket (more rarely where the others measured much slower) runs another candidate
once, so a change of load or machine is noticed.

`torch.set_num_threads` applies to the calling thread's OpenMP and MKL settings: the tuner
sets it in the thread that runs the step (the server's step loop), before each step.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# Steps per candidate before a bucket picks one; samples of a candidate that its median keeps;
# steps of a bucket between two probes of the other candidates (at least).
EXPLORE_STEPS = 3
WINDOW = 5
PROBE_EVERY = 32
PROBE_GAP = 0.25  # probes grow rarer by one probe_every per this much slower the others ran
logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def auto_choices(cores: int | None = None) -> tuple[int, ...]:
    """The counts `canvas serve` measures by default: every usable core but one (left to the
    front end and co-located clients), and every core."""
    cores = usable_cores() if cores is None else cores
    return tuple(sorted({max(1, cores - 1), cores}))


@dataclass(slots=True)
class _Bucket:
    times: dict[int, deque[float]]
    steps: int = 0
    next_probe: int = 0  # index into the other candidates, in turn
    best: int = 0  # the count the bucket's steps run with (0: still exploring)


@dataclass(slots=True)
class ThreadTuner:
    """Per step: `choose(num_tokens)` before it runs, `observe(...)` with its wall time."""

    choices: tuple[int, ...]
    explore_steps: int = EXPLORE_STEPS
    window: int = WINDOW
    probe_every: int = PROBE_EVERY
    set_threads: Callable[[int], None] | None = None  # default: torch's, when it differs
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.choices or min(self.choices) < 1:
            raise ValueError(f"thread counts must be >= 1, got {self.choices}")
        self.choices = tuple(sorted(set(self.choices)))

    @staticmethod
    def bucket(num_tokens: int) -> int:
        return round(2 * math.log2(max(1, num_tokens)))

    def _bucket(self, num_tokens: int) -> _Bucket:
        key = self.bucket(num_tokens)
        b = self._buckets.get(key)
        if b is None:
            b = _Bucket({n: deque(maxlen=self.window) for n in self.choices})
            self._buckets[key] = b
        return b

    def pick(self, num_tokens: int) -> int:
        """The count the next step of `num_tokens` tokens runs with (sets nothing)."""
        if len(self.choices) == 1:
            return self.choices[0]
        key = self.bucket(num_tokens)
        b = self._bucket(num_tokens)
        fewest = min(self.choices, key=lambda n: len(b.times[n]))
        if len(b.times[fewest]) < self.explore_steps:
            prior = self._prior(key)
            if prior is None:
                return fewest  # nothing near is known: each candidate in turn
            # A neighbouring bucket's choice runs; the others are tried every few steps (a
            # bucket that lives for a few steps costs no exploration).
            period = max(2, self.probe_every // 4)
            if b.steps % period == period - 1:
                return min((n for n in self.choices if n != prior), key=lambda n: len(b.times[n]))
            return prior
        best = min(self.choices, key=lambda n: statistics.median(b.times[n]))
        if best != b.best:
            b.best = best
            times = ", ".join(
                f"{statistics.median(t) * 1e3:.1f} ms with {n}" for n, t in b.times.items()
            )
            logger.info(
                "cpu threads: steps of ~%d tokens run with %d (%s)", num_tokens, best, times
            )
        others = [n for n in self.choices if n != best]
        # Probes cost their gap: the slower the others measured, the rarer (up to 8x).
        gap = min(statistics.median(b.times[n]) for n in others) / statistics.median(b.times[best])
        period = self.probe_every * min(8, max(1, math.ceil((gap - 1) / PROBE_GAP)))
        if b.steps % period == period - 1:
            return others[b.next_probe % len(others)]
        return best

    def _prior(self, key: int) -> int | None:
        """The choice of the nearest decided bucket within a factor of two, if any."""
        near = [(abs(k - key), k, b.best) for k, b in self._buckets.items() if b.best]
        near = [x for x in near if x[0] <= 2]
        return min(near)[2] if near else None

    def choose(self, num_tokens: int) -> int:
        """`pick`, applied to the calling thread."""
        threads = self.pick(num_tokens)
        if self.set_threads is not None:
            self.set_threads(threads)
        elif torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def observe(self, num_tokens: int, threads: int, seconds: float) -> None:
        b = self._bucket(num_tokens)
        if threads not in b.times:
            return  # set from outside the tuner's choices
        b.times[threads].append(seconds)
        if b.best and threads != b.best:
            b.next_probe += 1  # a probe: the next one tries the next candidate
        b.steps += 1

    def summary(self) -> dict[int, dict[int, float]]:
        """Per bucket (its lowest token count), each candidate's median step time (seconds)."""
        return {
            math.ceil(2 ** ((key - 0.5) / 2)): {
                n: statistics.median(t) for n, t in b.times.items() if t
            }
            for key, b in sorted(self._buckets.items())
        }


def make_tuner(choices: Sequence[int], exact: bool) -> ThreadTuner | None:
    """The engine's tuner: None leaves torch's thread count alone; exact numerics keep one count
    (the first, the smallest) so a request's bits never depend on which count a step ran with."""
    if not choices:
        return None
    return ThreadTuner((min(choices),) if exact else tuple(choices))
