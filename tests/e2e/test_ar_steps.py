"""All-AR steps' capture-ready inputs and graphs (`engine.device.ar_steps`) on a CPU: the
accountant's view of a bucketed AR step on the meta device (no allocation, no pageable copy,
no sync in the forward; with `--cuda-graphs`' wiring, `MetaCapture`, nothing from the host
inside the graph and the head inside it up to `HEAD_ROWS` rows), stable input addresses across
the steps of a bucket, and AR requests served through the fake graphs (`tests.graph_cases`:
the eager forward replayed over the padded bucket) giving the eager tokens, greedy and
sampled; and the roofline's prediction of a replayed AR step of one request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.device.graphs import HEAD_ROWS
from engine.device.step_buffers import bucket_sizes
from engine.llm import LLM
from engine.model.config import LayerType
from engine.model.kv_cache import ForwardBatch
from engine.params import DecodeMode, SamplingParams
from kernels import resolve_kernels
from loadtest.gpu import roofline
from loadtest.gpu.accountant import GPUS, Accountant
from loadtest.gpu.bench import model_config
from tests.graph_cases import EagerCapture, fake_graphs


def _account(rows: int, graphs: bool) -> tuple[roofline.StepHarness, Accountant]:
    """A step of `rows` AR rows after its bucket's first (which captured, with `graphs`),
    accounted on the meta device, the buckets doubling up to the one that holds them."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    meta = torch.device("meta")
    model = roofline.build(model_config(toy=True), kernels, meta)
    with torch.inference_mode():
        harness = roofline.StepHarness(model, "ar", rows, meta, graphs=graphs)
        largest = 1 << (rows - 1).bit_length()
        harness.runner.ar.inputs.sizes = bucket_sizes(largest)
        harness.run()
        acct = Accountant("meta")
        harness.run(acct)
    assert largest in harness.runner.ar.inputs.buckets
    return harness, acct


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_a_bucketed_ar_step_allocates_no_input_copies_from_pinned_memory_and_never_waits(
    rows: int,
) -> None:
    """Eager (3 rows: bucket 4): the forward's inputs are two in-place copies from pinned
    mirrors (the int64 and int32 columns, token ids among the first), nothing is allocated for
    them, no copy is pageable and nothing waits in the forward."""
    _, acct = _account(rows, graphs=False)
    assert acct.syncs(("inputs", "forward")) == [] and acct.pageable_copies() == []
    inputs = [(r.name, r.copy) for r in acct.records if r.copy and r.phase in ("inputs", "forward")]
    assert inputs == [("copy_", "pinned")] * 2
    assert not [r for r in acct.records if r.phase == "inputs" and r.name.startswith("empty")]


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_a_replayed_ar_step_holds_no_allocation_sync_or_host_copy_inside_or_around_its_graph(
    rows: int,
) -> None:
    """`--cuda-graphs` on the meta device: inside the replayed graph nothing waits, nothing
    is copied from the host and nothing is launched from the host; around it the forward's only
    launches are the two pinned input copies, the page tables' gathers (and, with dummy rows,
    their fill) and the graph; up to `HEAD_ROWS` rows the head is in the graph, past them eager."""
    harness, acct = _account(rows, graphs=True)
    graphs = harness.runner.ar.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1 << (rows - 1).bit_length()]
    captured = [r for r in acct.records if r.captured]
    assert captured and not [r for r in captured if r.sync or r.copy or r.host_launches]
    assert acct.syncs(("inputs", "forward")) == [] and acct.pageable_copies() == []
    around = [r for r in acct.records if r.phase in ("inputs", "forward") and not r.captured]
    assert [(r.name, r.copy) for r in around if r.copy] == [("copy_", "pinned")] * 2
    launched = {r.name for r in around if r.host_launches}
    head = {"canvas.softcap"} & {r.name for r in captured}
    if rows <= HEAD_ROWS:
        assert launched <= {"graph.replay", "copy_", "index_select", "fill_"}, launched
        assert head and not [r for r in around if r.name.startswith(("empty", "zeros", "full"))]
    else:
        assert not head and "canvas.softcap" in launched


def test_the_roofline_predicts_a_replayed_ar_step_of_one_request_near_its_floor() -> None:
    """At the real shapes (`--cuda-graphs`, `MetaCapture`): the same work as eager, its launches
    but a handful, within 1.5x its floor on an H200 and an H100 (eager: launch-bound)."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    model = roofline.build(model_config(), kernels, torch.device("meta"))
    eager, graphed = (roofline.account(model, "ar", 1, graphs=g) for g in (False, True))
    assert graphed.acct.launches < 30 < 600 < eager.acct.launches
    for hw in GPUS:
        free = hw.with_launch(0.0)
        assert graphed.seconds(free) == pytest.approx(eager.seconds(free), rel=1e-3)
        floor = roofline.floor_s(graphed, hw)
        assert graphed.seconds(hw) <= 1.5 * floor < eager.seconds(hw), hw.name


def _pointers(batch: ForwardBatch) -> tuple[int, ...]:
    cpu = torch.device("cpu")
    ptrs = [batch.positions(cpu).data_ptr()]
    for pool in LayerType:
        rows = batch.paged_rows(pool, cpu)
        ptrs += [t.data_ptr() for t in (rows.start, rows.offset, rows.decode, rows.page_table)]
    return tuple(ptrs)


def _generate(
    llm: LLM, graphs: EagerCapture | None, temperature: float
) -> tuple[list[list[int]], dict[int, set]]:
    """Three AR requests (steps of 3 rows: bucket 4, one dummy row) and the input addresses of
    each AR bucket's steps."""
    runner = llm.engine.runner
    if graphs is not None:
        fake_graphs(llm.engine, graphs)
    inputs = runner.ar.inputs
    seen: dict[int, set] = {}
    kept: list[object] = []  # every step's inputs stay alive: a new one cannot take their address
    batch = inputs.batch

    def recorded(starts, pages, bucket, pad=False, tokens=None):  # type: ignore[no-untyped-def]
        out = batch(starts, pages, bucket, pad, tokens)
        seen.setdefault(bucket, set()).add((*_pointers(out), inputs.ids(bucket).data_ptr()))
        kept.append(out)
        return out

    inputs.batch = recorded  # type: ignore[method-assign]
    params = [
        SamplingParams(
            mode=DecodeMode.AR, seed=i, temperature=temperature, max_tokens=12, ignore_eos=True
        )
        for i in range(3)
    ]
    outputs = llm.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13]], params)
    return [o.output_ids for o in outputs], seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ar_requests_through_the_padded_ar_graphs_give_the_eager_tokens(
    tiny_checkpoint: Callable[[str], Path], temperature: float
) -> None:
    eager, seen = _generate(LLM.from_pretrained(tiny_checkpoint("c32-window")), None, temperature)
    assert 4 in seen and all(len(pointers) == 1 for pointers in seen.values()), seen
    fake = EagerCapture()
    llm = LLM.from_pretrained(tiny_checkpoint("c32-window"))
    replayed, seen = _generate(llm, fake, temperature)
    assert llm.engine.runner.ar.graphs is not None and 4 in llm.engine.runner.ar.graphs.graphs
    assert fake.replays > 0 and 4 in fake.captured  # the whole bucket, dummy row included
    assert all(len(pointers) == 1 for pointers in seen.values()), seen
    assert replayed == eager
    assert len({len(o) for o in replayed}) == 1 and len(replayed[0]) == 12
