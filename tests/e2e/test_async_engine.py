"""The async engine's step loop: a burst of requests at an idle engine starts in one step."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams


def first_step_rows(model_dir, gather: tuple[float, float], spacing: float) -> int:
    """Rows of the first step when 4 requests arrive `spacing` seconds apart at an idle
    engine."""
    llm = LLM.from_pretrained(model_dir)
    engine = AsyncEngine(llm.engine, gather=gather)
    rows: list[int] = []
    engine.on_step.append(lambda stats, outputs: rows.append(stats.num_rows))
    params = llm.validator.validate([5, 6, 7], SamplingParams(max_tokens=2, mode=DecodeMode.AR))

    async def main() -> None:
        engine.start(asyncio.get_running_loop())

        async def one(i: int) -> None:
            await asyncio.sleep(spacing * i)
            async for _ in engine.generate(f"r{i}", [5, 6, 7 + i], params):
                pass

        await asyncio.gather(*(one(i) for i in range(4)))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    return rows[0]


@pytest.mark.parametrize(
    "gather, spacing, expected",
    [
        ((0.5, 2.0), 0.02, 4),  # each within the gap: one prefill step for all four
        ((0.0, 0.0), 0.02, 1),  # no gather: the first request steps alone
        ((0.5, 0.05), 0.2, 1),  # the gather's cap (50 ms) ends it before the second arrives
    ],
    ids=["gathered", "off", "capped"],
)
def test_a_burst_at_an_idle_engine_starts_in_one_step(tiny_checkpoint, gather, spacing, expected):
    """Stepping at the first arrival split a burst of 16 over two prefill steps through the
    server (18 steps where an offline batch takes 17 on bench-tiny)."""
    rows = first_step_rows(tiny_checkpoint("c16"), gather, spacing)
    assert rows == expected if expected == 4 else rows < 4
