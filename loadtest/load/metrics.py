"""The engine's own overhead, read from a Canvas server's /metrics.

Canvas exports the wall time of every engine step (`canvas:step_seconds`), of the model
forward inside it (`canvas:forward_seconds`) and of the sampler's arithmetic
(`canvas:sample_seconds`) as histograms, and counts the steps run with each CPU thread count
(`canvas:cpu_thread_steps`). Step minus forward minus sampler, between two
scrapes, is the time the engine spent scheduling, preparing inputs and publishing outputs
during that interval. A server without these metrics (not Canvas) gives None.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import httpx

from loadtest.load.stats import EngineOverhead

logger = logging.getLogger(__name__)
STEP = "canvas:step_seconds"
FORWARD = "canvas:forward_seconds"
SAMPLE = "canvas:sample_seconds"
THREAD_STEPS = "canvas:cpu_thread_steps_total"


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Cumulative step histogram totals at one scrape (summed over label sets)."""

    num_steps: float
    step_seconds: float
    forward_seconds: float
    sample_seconds: float = 0.0
    thread_steps: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def between(before: StepTotals | None, after: StepTotals | None) -> EngineOverhead | None:
        if before is None or after is None:
            return None
        return EngineOverhead(
            num_steps=round(after.num_steps - before.num_steps),
            step_seconds=after.step_seconds - before.step_seconds,
            forward_seconds=after.forward_seconds - before.forward_seconds,
            sample_seconds=after.sample_seconds - before.sample_seconds,
            thread_steps={
                n: delta
                for n, steps in after.thread_steps.items()
                if (delta := round(steps - before.thread_steps.get(n, 0.0))) > 0
            },
        )


def parse_step_totals(text: str) -> StepTotals | None:
    """Totals from Prometheus exposition text; None when the step histograms are absent."""
    values: dict[str, float] = {}
    threads: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == THREAD_STEPS and (count := re.search(r'threads="(\d+)"', line)):
            n = int(count.group(1))
            threads[n] = threads.get(n, 0.0) + float(line.rsplit(" ", 1)[1])
        if name in (f"{STEP}_count", f"{STEP}_sum", f"{FORWARD}_sum", f"{SAMPLE}_sum"):
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if len(values) < 3:
        return None
    return StepTotals(
        values[f"{STEP}_count"],
        values[f"{STEP}_sum"],
        values[f"{FORWARD}_sum"],
        values.get(f"{SAMPLE}_sum", 0.0),
        threads,
    )


async def read_step_totals(client: httpx.AsyncClient) -> StepTotals | None:
    """Scrape GET /metrics of the client's server; None if unavailable."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError as exc:
        logger.debug("no /metrics: %s", exc)
        return None
    if response.status_code != 200:
        return None
    return parse_step_totals(response.text)
