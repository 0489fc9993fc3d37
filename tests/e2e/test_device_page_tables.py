"""The runner's device page tables (`engine.model.kv_cache.DevicePageTables`) hold, at every
step of every kind (prefill, denoise, commit, AR, hybrid verify, exact numerics' one-token
verify rows), exactly the tables that packing each row's page lists gives, while a sequence's
row is written only when its tables change."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.draft_policy import DraftPolicy
from engine.engine import EngineConfig
from engine.kv_pages import PageTables
from engine.llm import LLM
from engine.model.config import LayerType
from engine.model.kv_cache import DevicePageTables
from engine.params import DecodeMode, SamplingParams
from engine.runner import StepInputs
from engine.scheduler import SchedulerConfig
from kernels.reference import PagedRows


def _packed(tables: list[list[int]]) -> list[list[int]]:
    """The page-table values the kernels got before device tables: the rows' lists, packed."""
    num = len(tables)
    return PagedRows.build([0] * num, [1] * num, [False] * num, tables).page_table.tolist()


def _lists(pages: PageTables, pool: LayerType) -> list[int]:
    return pages.full if pool is LayerType.FULL else pages.sliding()


def _row_pages(step: StepInputs, exact: bool) -> tuple[list[PageTables], set[str]]:
    """Each forward row's page tables, as the runner orders its rows, and the kinds present."""
    held, kinds = list(step.denoise_pages), {"denoise"} if step.denoise_pages else set()
    for e in step.encode:
        split = exact and e.verify
        held += [e.pages] * (len(e.tokens) if split else 1)
        kinds.add("verify" if e.verify else "ar" if len(e.tokens) == 1 else "prefill/commit")
    return held, kinds


def _checked_generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> set[str]:
    runner, exact = llm.engine.runner, llm.engine.model.kernels.exact
    kinds: set[str] = set()
    pools = sorted(set(runner.cache.layer_types), key=lambda t: t.value)
    execute, gather = runner.execute, runner.tables.gather
    steps: list[StepInputs] = []
    mismatches: list[Any] = []

    def checked_gather(pages: list[PageTables]) -> dict[LayerType, torch.Tensor]:
        held, step_kinds = _row_pages(steps[-1], exact)
        assert pages == held, "the runner's rows and their page tables disagree"
        kinds.update(step_kinds)
        out = gather(pages)
        for pool in pools:
            want = _packed([_lists(p, pool) for p in held])
            if out[pool].tolist() != want:
                mismatches.append((pool, out[pool].tolist(), want))
        return out

    def recorded_execute(step: StepInputs) -> Any:
        steps.append(step)
        return execute(step)

    runner.execute, runner.tables.gather = recorded_execute, checked_gather  # type: ignore[method-assign]
    try:
        llm.generate(prompts, params)
    finally:
        del runner.execute, runner.tables.gather
    assert steps and not mismatches, mismatches[:1]
    return kinds


def _requests(seed: int, modes: list[DecodeMode]) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 250) for _ in range(40)]  # a cached prefix for the later ones
    prompts = [shared + [rng.randrange(5, 250) for _ in range(rng.randrange(1, 30))] for _ in modes]
    params = [
        SamplingParams(mode=m, seed=i, max_tokens=16, max_denoising_steps=2, ignore_eos=True)
        if m is not DecodeMode.AR
        else SamplingParams(mode=m, seed=i, max_tokens=16, ignore_eos=True)
        for i, m in enumerate(modes)
    ]
    return prompts, params


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_device_page_tables_equal_the_packed_lists_at_every_step_of_every_kind(
    tiny_checkpoint: Callable[[str], Path], exact: bool
):
    sched = SchedulerConfig(draft_policy=DraftPolicy(adaptive=False), max_prefill_chunk=24)
    llm = LLM.from_pretrained(
        tiny_checkpoint("c32-window"), exact=exact, config=EngineConfig(scheduler=sched)
    )
    modes = [DecodeMode.DIFFUSION, DecodeMode.AR, DecodeMode.HYBRID] * 2
    prompts, params = _requests(0, modes)
    kinds = _checked_generate(llm, prompts[:3], params[:3])
    if not exact:  # prefix hits on the pages left (exact numerics never cache)
        kinds |= _checked_generate(llm, prompts[3:], params[3:])
        # ... and a sliding page swapped under a running request rewrote its row
        assert llm.engine.runner.tables.rows_written > len(prompts)
    assert kinds == {"denoise", "verify", "ar", "prefill/commit"}


def _tables(full: list[int], ring: list[int], num_logical: int) -> PageTables:
    return PageTables(full=full, ring=ring, num_logical=num_logical)


def test_a_row_is_written_only_when_its_tables_change_and_rows_are_reused():
    tables = DevicePageTables([LayerType.FULL, LayerType.SLIDING], torch.device("cpu"), 2, 4)
    a, b, c = _tables([0, 1, 2], [5, 6], 3), _tables([3], [7], 1), _tables([4, 8, 9, 10, 11], [], 5)
    check = lambda held: [  # noqa: E731
        tables.gather(held)[pool].tolist() == _packed([_lists(p, pool) for p in held])
        for pool in (LayerType.FULL, LayerType.SLIDING)
    ]
    assert check([a, b, a]) == [True, True] and tables.rows_written == 2
    assert check([b, a]) == [True, True] and tables.rows_written == 2  # nothing changed
    a.set_ring_page(1, 9)  # a ring swap: only `a` is written again
    assert check([a]) == [True, True] and tables.rows_written == 3
    # `c` is wider than the table and a third sequence: the table grows, nothing is lost
    assert check([a, b, c]) == [True, True] and tables.rows_written == 4
    assert tables.max_pages >= 5 and tables.host[LayerType.FULL].shape[0] >= 3
    d = _tables([12], [13], 1)  # takes the row that went unused longest, `b`'s or `c`'s
    assert check([a, d]) == [True, True] and check([a, d, b]) == [True, True]
