"""The extension points are registries: a decode mode and a row kind registered here, with
their own code only, run requests end to end through the engine with no edit elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from engine import modes, rows
from engine.llm import LLM
from engine.modes import Autoregressive
from engine.params import DecodeMode, DecodingDefaults, ParamError, SamplingParams
from engine.request import RequestState
from engine.rows import ArRow, PlanContext
from engine.types import ScheduledRow

TOY_KIND = "toy-token"
TOY_MODE = "toy-greedy"


class CountingTokenRow(ArRow):
    """A toy row kind: the AR row's work under its own name, counting the rows it planned."""

    def __init__(self) -> None:
        self.planned = 0

    def plan(self, seq: RequestState, ctx: PlanContext) -> ScheduledRow | None:
        self.planned += 1
        return ScheduledRow(seq, TOY_KIND, seq.num_computed, 1, ctx.admitted)


class GreedyTokens(Autoregressive):
    """A toy mode: one token per encoder pass through the toy row kind, always greedy —
    `temperature` means nothing in it."""

    after_prefill = TOY_KIND

    def apply_temperature(
        self, params: SamplingParams, defaults: DecodingDefaults
    ) -> SamplingParams:
        return replace(params, temperature=0.0)


@pytest.fixture
def toy_kind() -> Iterator[CountingTokenRow]:
    kind = CountingTokenRow()
    rows.register(TOY_KIND, kind)
    modes.register(TOY_MODE, GreedyTokens())
    yield kind
    del rows.ROW_KINDS[TOY_KIND], modes.MODES[TOY_MODE]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Callable[[str], Path]) -> LLM:
    return LLM.from_pretrained(tiny_checkpoint("c16"), exact=True)


def test_a_registered_mode_and_row_kind_run_end_to_end(llm: LLM, toy_kind: CountingTokenRow):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    toy = llm.generate(prompts, SamplingParams(max_tokens=6, mode=TOY_MODE, temperature=1.5))
    greedy = llm.generate(prompts, SamplingParams(max_tokens=6, mode=DecodeMode.AR))
    assert [o.output_ids for o in toy] == [o.output_ids for o in greedy]
    assert all(len(o.output_ids) == 6 for o in toy)
    assert toy_kind.planned == 2 * 5  # the first token comes with the prompt, then one a row


def test_a_mode_or_kind_registered_twice_is_refused_and_an_unknown_mode_names_the_choices(
    toy_kind: CountingTokenRow,
):
    with pytest.raises(ValueError, match="registered already"):
        rows.register(TOY_KIND, toy_kind)
    with pytest.raises(ValueError, match="registered already"):
        modes.register(DecodeMode.AR, GreedyTokens())
    with pytest.raises(ParamError, match=f"mode: must be one of .*'{TOY_MODE}'"):
        SamplingParams(mode="speculative")
