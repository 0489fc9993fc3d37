"""The CPU thread count of each engine step, chosen by measuring steps (`ThreadTuner`).

A CPU operator runs as an OpenMP region whose threads wait for each other at its end. Where a
step's operators are small (a small model, a step of a few tokens) a second thread costs more
in hand-offs than it adds, and when the HTTP front end or a client on the same machine takes a
core from one of the threads, the whole region waits for it. Where the GEMMs are large every
core pays, stalls included. Which side wins depends on the model, the step's size and what else
runs on the machine (a sidecar server and its load generator may share the same few cores:
large canvas steps favour every core, small AR steps sometimes one fewer). So the engine
measures it.
Steps are grouped by their token count (half-octave buckets). A bucket runs one count, its
*incumbent* (at first the largest, or the choice of a decided bucket within a factor of two),
and now and then a step with another count, a *probe*. A probe is compared with the incumbent's
last few steps, not with older probes: a machine whose speed drifts (shared VMs drift by tens
of percent within minutes) shifts both alike, so the ratio holds where absolute times would
not. Probes alternate with incumbent steps until each other count has a few ratios (every few
steps next to a decided bucket); then the median ratio decides, probes go on every few steps
until each count has WINDOW ratios, then every `probe_every` steps (more rarely the slower the
others measured), so a change of load is noticed and followed.

The two mistakes cost differently: too many threads on a small step loses a few hand-offs,
too few on a large step loses up to a core's worth of the step. So a bucket starts at the
largest count and moves to a smaller one only when it measured at least SWITCH_MARGIN faster,
and a bucket with more tokens than one that settled on the largest count runs it unprobed
(more work per region only favours more threads). Starting at the smallest instead let a
few noisy probes settle a large step on too few threads, with the probes that would correct
it far apart.

`torch.set_num_threads` applies to the calling thread's OpenMP and MKL settings: the tuner
sets it in the thread that runs the step (the server's step loop), before each step.

Only the step loop should run parallel regions (`confine_to_steps`): GNU OpenMP keeps a team of
worker threads for every thread that ever ran a region, and once it manages more threads than
there are cores, every team's workers sleep between regions instead of spinning, so each region
pays a futex wake-up.
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

# Probe ratios per other count before a bucket decides, and kept for its median; the
# incumbent's recent steps a probe is compared with; steps between probes once decided (at
# least); probes grow rarer by one probe_every per PROBE_GAP of the others' slowness.
EXPLORE_STEPS = 3
WINDOW = 5
RECENT = 3
PROBE_EVERY = 32
PROBE_GAP = 0.25
# A smaller count replaces the incumbent only when its median ratio is under 1 - this.
SWITCH_MARGIN = 0.1
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
    incumbent: int
    recent: deque[float]  # the incumbent's last step times
    ratios: dict[int, deque[float]]  # per other count: probe time / the incumbent's recent median
    prior: bool  # the incumbent came from a neighbouring bucket's decision
    decided: bool = False
    steps: int = 0
    next_probe: int = 0  # the other counts are probed in turn
    # Derived from the above after every probe (`ThreadTuner._schedule`): a probe runs every
    # `period` steps, of one of `probes` in turn.
    period: int = 2
    probes: tuple[int, ...] = ()


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
            near = [(abs(k - key), k, x.incumbent) for k, x in self._buckets.items() if x.decided]
            near = [x for x in near if x[0] <= 2]
            prior = min(near)[2] if near else None
            # Steps with more tokens than a bucket that settled on every thread would run no
            # faster on fewer: their probes are not paid (a rare large step, such as a burst's
            # prompts, probed on one thread costs a whole step's worth).
            settled = any(
                k < key and x.decided and x.incumbent == self.choices[-1]
                for k, x in self._buckets.items()
            )
            incumbent = self.choices[-1] if prior is None or settled else prior
            others = () if settled else tuple(n for n in self.choices if n != incumbent)
            ratios: dict[int, deque[float]] = {n: deque(maxlen=self.window) for n in others}
            b = _Bucket(incumbent, deque(maxlen=RECENT), ratios, prior is not None, settled)
            self._schedule(b)
            self._buckets[key] = b
        return b

    def _schedule(self, b: _Bucket) -> None:
        """The bucket's probe period and the counts it probes, from its ratios so far."""
        if not b.ratios:  # settled by a smaller bucket: nothing to probe
            b.period, b.probes = 1 << 30, ()
            return
        if not b.decided:
            b.period = max(2, self.probe_every // 4) if b.prior else 2
            b.probes = tuple(n for n, r in b.ratios.items() if len(r) < self.explore_steps)
            return
        gap = min(statistics.median(r) for r in b.ratios.values())
        b.period = self.probe_every * min(8, max(1, math.ceil((gap - 1) / PROBE_GAP)))
        if any(len(r) < self.window for r in b.ratios.values()):
            b.period = min(b.period, max(2, self.probe_every // 4))  # until the window is full
        b.probes = tuple(b.ratios)

    def pick(self, num_tokens: int) -> int:
        """The count the next step of `num_tokens` tokens runs with (sets nothing)."""
        if len(self.choices) == 1:
            return self.choices[0]
        b = self._bucket(num_tokens)
        if not b.recent or not b.probes:
            return b.incumbent  # a probe needs the incumbent's time beside it
        if b.steps % b.period == b.period - 1:
            return b.probes[b.next_probe % len(b.probes)]
        return b.incumbent

    def choose(self, num_tokens: int) -> int:
        """`pick`, applied to the calling thread."""
        threads = self.pick(num_tokens)
        # Set on every step, not only on a change: another thread's `torch.set_num_threads`
        # (`one_thread`) also sets MKL's process-wide count (microseconds either way).
        (self.set_threads or torch.set_num_threads)(threads)
        return threads

    def observe(self, num_tokens: int, threads: int, seconds: float) -> None:
        if len(self.choices) == 1:
            return
        b = self._bucket(num_tokens)
        b.steps += 1
        if threads == b.incumbent:
            b.recent.append(seconds)
            return
        if threads not in b.ratios or not b.recent:
            return  # set from outside the tuner's choices, or nothing to compare with
        b.ratios[threads].append(seconds / statistics.median(b.recent))
        b.next_probe += 1
        if b.decided:
            if self._maybe_switch(b, threads, seconds):
                self._report(num_tokens, b, "switched")
        elif all(len(r) >= self.explore_steps for r in b.ratios.values()):
            b.decided = True
            self._maybe_switch(b, threads, seconds)
            self._report(num_tokens, b, "measured")
        self._schedule(b)

    def _maybe_switch(self, b: _Bucket, probed: int, seconds: float) -> bool:
        """The probed count becomes the incumbent when its median ratio is the lowest and under
        1 (under 1 - SWITCH_MARGIN for a smaller count than the incumbent's)."""
        ratio = statistics.median(b.ratios[probed])
        bar = 1 - SWITCH_MARGIN if probed < b.incumbent else 1.0
        if ratio >= bar or ratio > min(statistics.median(r) for r in b.ratios.values()):
            return False
        old = b.incumbent
        # The other counts' ratios, rescaled to the new incumbent; the old one's, inverted.
        ratios = {
            n: deque((x / ratio for x in r), maxlen=self.window)
            for n, r in b.ratios.items()
            if n != probed
        }
        ratios[old] = deque((1 / x for x in b.ratios[probed]), maxlen=self.window)
        b.incumbent, b.ratios = probed, ratios
        b.recent = deque([seconds], maxlen=RECENT)
        return True

    def _report(self, num_tokens: int, b: _Bucket, why: str) -> None:
        ratios = ", ".join(f"{statistics.median(r):.2f}x with {n}" for n, r in b.ratios.items())
        logger.info(
            "cpu threads: steps of ~%d tokens run with %d (%s; step time %s)",
            num_tokens,
            b.incumbent,
            why,
            ratios,
        )

    def summary(self) -> dict[int, tuple[int, dict[int, float]]]:
        """Per bucket (its lowest token count): its incumbent count and each other count's
        median step time relative to the incumbent's (probe ratios)."""
        return {
            math.ceil(2 ** ((key - 0.5) / 2)): (
                b.incumbent,
                {n: statistics.median(r) for n, r in b.ratios.items() if r},
            )
            for key, b in sorted(self._buckets.items())
        }


def make_tuner(choices: Sequence[int], exact: bool) -> ThreadTuner | None:
    """The engine's tuner; None leaves torch's thread count alone. Exact numerics never measure:
    their bits depend on the thread count (a CPU GEMM's last bits do, in Canvas and in the
    transformers reference alike), so they run with the
    count a reference run has, torch's own (its default, or OMP_NUM_THREADS), unless one count
    is fixed."""
    if not choices or (exact and len(set(choices)) > 1):
        return None
    return ThreadTuner(tuple(choices))


def confine_to_steps() -> int:
    """Leave torch's parallel regions to the engine's step loop, in a server process, before
    the model loads: the calling thread (the main thread) runs torch on one thread from now on,
    and so do threads that start torch later until the step loop sets its count. Returns the
    count torch had (its default, or OMP_NUM_THREADS), which the step loop then uses or
    measures against (`EngineConfig.cpu_threads`).

    Why: GNU OpenMP keeps a team of worker threads for each thread that has run a parallel
    region. With the main thread's team (built while the model loaded) beside the step loop's,
    it manages more threads than the machine has cores, and then every team's workers sleep
    between regions instead of spinning: each region pays a futex wake-up, several times the
    cost of a small element-wise op, and a step runs thousands of regions
    (docs/performance.md has the measurements)."""
    count = torch.get_num_threads()
    one_thread()
    return count


def one_thread() -> None:
    """torch on one thread in the calling thread (a helper thread of a confined server: its
    parallel regions would build an OpenMP team beside the step loop's)."""
    torch.set_num_threads(1)


def choose_threads(
    requested: str | None, own: int | None = None, exact: bool = False
) -> tuple[int, ...]:
    """The CPU thread counts an engine runs its steps with (`EngineConfig.cpu_threads`), from
    a `--threads` value: a count fixes it; "auto", the default (None) unless OMP_NUM_THREADS is
    set (then torch's count, which follows it), measures every usable core but one against
    every core, per step size, and runs each step with the faster (`ThreadTuner`). Why measure:
    a sidecar's front end and co-located clients take cores from the model's OpenMP regions,
    which then stall; where a step is a few small operators a second thread costs more in
    hand-offs than it adds. `own`: torch's count before `confine_to_steps` set the calling
    thread's to one (None: ask torch); a confined server runs exact numerics, which are never
    measured, at that count, set by the step loop (a tuner that does not measure sets none,
    and the loop would inherit one). Raises ValueError naming --threads for anything else."""
    if requested is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return (own or torch.get_num_threads(),)
        requested = "auto"
    if requested == "auto":
        choices = auto_choices()
        return (own,) if own is not None and exact and len(choices) > 1 else choices
    try:
        count = int(requested)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"--threads must be 'auto' or a count of at least 1, got {requested!r}")
    return (count,)


def describe_threads(choices: tuple[int, ...], exact: bool = False) -> str:
    """A banner's words for `choices` (exact numerics are never measured: torch's count)."""
    if len(choices) == 1:
        return str(choices[0])
    if exact:
        return f"{torch.get_num_threads()} (torch's own: exact numerics' bits depend on the count)"
    counts = " or ".join(map(str, choices))
    return f"{counts}, per step, whichever measures faster (--threads auto)"
