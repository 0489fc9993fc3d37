"""Capture-ready inputs of all-denoise steps (`engine.device.step_buffers`) and the wiring of
their CUDA graphs (`engine.device.graphs`) on a CPU: buckets, the accountant's view on the meta
device (no pageable copy, no sync in the forward and sampler at any bucket), stable addresses
across the steps of a bucket, and a fake graph that replays the eager forward over the padded
bucket (`tests.graph_cases`), whose tokens must be the eager ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.device import warmup
from engine.device.graphs import HEAD_ROWS, ForwardGraphs
from engine.device.step_buffers import SamplerInputs, bucket_of, bucket_sizes
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.model.config import LayerType
from engine.model.kv_cache import ForwardBatch
from engine.params import DecodeMode, SamplingParams
from engine.runner import ModelRunner
from engine.scheduler import SchedulerConfig
from kernels import resolve_kernels
from loadtest.gpu import roofline
from loadtest.gpu.accountant import Accountant
from loadtest.gpu.bench import model_config
from tests.graph_cases import EagerCapture, fake_graphs


def test_buckets_double_up_to_the_largest_step() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(16) == (1, 2, 4, 8, 16)
    assert bucket_sizes(24) == (1, 2, 4, 8, 16, 24)
    sizes = bucket_sizes(24)
    assert [bucket_of(n, sizes) for n in (0, 1, 3, 4, 5, 17, 24, 25)] == [
        None, 1, 4, 4, 8, 24, 24, None,
    ]  # fmt: skip


@pytest.mark.parametrize("canvases", [1, 2, 3, 4, 8, 16])
def test_a_bucketed_denoise_step_allocates_no_input_copies_from_pinned_memory_and_never_waits(
    canvases: int,
) -> None:
    """On the meta device, at every bucket (3 canvases: bucket 4, one dummy row), a step after
    the bucket's first: its inputs are four in-place copies from pinned mirrors (slots, flags,
    the forward's int64 and int32 columns), nothing is allocated for them, no copy is pageable
    and nothing waits in the forward and the sampler; the next step of the same rows copies
    only the slots and flags (the forward's inputs are in their buffers as written)."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    meta = torch.device("meta")
    model = roofline.build(model_config(toy=True), kernels, meta)
    with torch.inference_mode():
        harness = roofline.StepHarness(model, "denoise", canvases, meta)
        largest = 1 << (canvases - 1).bit_length()
        harness.runner.inputs.sizes = bucket_sizes(largest)
        harness.staged = SamplerInputs(meta, largest)
        harness.run()
        harness.runner.tables.place([])  # another step's tables: the batch is written again
        acct = Accountant("meta")
        harness.run(acct)
        again = Accountant("meta")
        harness.run(again)
    assert largest in harness.runner.inputs.buckets
    assert acct.syncs(("forward", "sampler")) == []
    assert acct.pageable_copies() == []
    copies = [(r.name, r.copy) for r in acct.records if r.copy]
    assert copies == [("copy_", "pinned")] * 4
    assert not [r for r in acct.records if r.phase == "inputs" and r.name.startswith("empty")]
    assert [(r.name, r.copy) for r in again.records if r.copy] == [("copy_", "pinned")] * 2


@pytest.mark.parametrize("canvases", [1, 2, 3, 4, 8])
def test_a_replayed_step_holds_no_allocation_sync_or_host_copy_inside_or_around_its_graphs(
    canvases: int,
) -> None:
    """`--cuda-graphs` on the meta device (`MetaCapture`), at every bucket (3 canvases: bucket
    4, one dummy row): inside the replayed graphs nothing waits, nothing is copied from the
    host and nothing is launched from the host; around them the step's only launches are the
    four pinned input copies, the page tables' gathers, the graphs themselves and, in a bucket
    with a dummy row, the sampler's state write; nothing is allocated before the publish. At
    1 to 4 canvases (`HEAD_ROWS`) the head and sampler are inside the graphs; at 8 only the
    forward is."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    meta = torch.device("meta")
    model = roofline.build(model_config(toy=True), kernels, meta)
    with torch.inference_mode():
        harness = roofline.StepHarness(model, "denoise", canvases, meta, graphs=True)
        largest = 1 << (canvases - 1).bit_length()
        harness.runner.inputs.sizes = harness.staged.sizes = bucket_sizes(largest)
        harness.run()  # captures
        harness.runner.tables.place([])  # another step's tables: the batch is written again
        acct = Accountant("meta")
        harness.run(acct)
    captured = [r for r in acct.records if r.captured]
    assert captured and not [r for r in captured if r.sync or r.copy or r.host_launches]
    assert acct.syncs(("inputs", "forward", "sampler")) == [] and acct.pageable_copies() == []
    assert [(r.name, r.copy) for r in acct.records if r.copy] == [("copy_", "pinned")] * 4
    stepping = [r for r in acct.records if r.phase != "publish" and not r.captured]
    launched = {r.name for r in stepping if r.host_launches}
    allowed = {"graph.replay", "copy_", "index_select", "fill_"}
    if canvases <= HEAD_ROWS:
        allowed |= {"index_put_"} if canvases < largest else set()
        assert launched <= allowed, launched
        assert not [r for r in stepping if r.name.startswith(("empty", "zeros", "full"))]
        assert "canvas.fused_sample" in {r.name for r in captured}
    else:
        assert {"canvas.softcap", "canvas.fused_sample", "index_put_"} <= launched


def _pointers(batch: ForwardBatch) -> tuple[int, ...]:
    """The addresses of every input a forward of `batch` reads."""
    cpu = torch.device("cpu")
    ptrs = [batch.positions(cpu).data_ptr()]
    for pool in LayerType:
        rows = batch.paged_rows(pool, cpu)
        ptrs += [t.data_ptr() for t in (rows.start, rows.offset, rows.decode, rows.page_table)]
    return tuple(ptrs)


def _generate(llm: LLM, graphs: EagerCapture | None) -> tuple[list[list[int]], dict[int, set]]:
    """Three diffusion requests (steps of 3 canvases: bucket 4, one dummy row) and the input
    addresses of each bucket's steps."""
    runner: ModelRunner = llm.engine.runner
    if graphs is not None:
        fake_graphs(llm.engine, graphs)
        runner.graphs.capture_all()  # as warm-up does (its buffers made in inference mode)
    seen: dict[int, set] = {}
    kept: list[object] = []  # every step's inputs stay alive: a new one cannot take their address
    batch, stage = runner.inputs.batch, llm.engine.sampling.inputs.stage  # type: ignore[attr-defined]

    def recorded_batch(starts, pages, bucket, pad=False, tokens=None):  # type: ignore[no-untyped-def]
        out = batch(starts, pages, bucket, pad, tokens)
        seen.setdefault(bucket, set()).add(_pointers(out))
        kept.append(out)
        return out

    def recorded_stage(slots, starting):  # type: ignore[no-untyped-def]
        out = stage(slots, starting)
        seen.setdefault(-len(slots), set()).add(tuple(t.data_ptr() for t in out))
        kept.append(out)
        return out

    runner.inputs.batch = recorded_batch  # type: ignore[method-assign]
    llm.engine.sampling.inputs.stage = recorded_stage  # type: ignore[attr-defined]
    params = [
        SamplingParams(
            mode=DecodeMode.DIFFUSION, seed=i, max_tokens=24, max_denoising_steps=4, ignore_eos=True
        )
        for i in range(3)
    ]
    outputs = llm.generate([[5, 6, 7, 8], [9, 10], [11, 12, 13]], params)
    return [o.output_ids for o in outputs], seen


def test_inputs_keep_their_addresses_and_a_replayed_padded_forward_gives_the_eager_tokens(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    eager, seen = _generate(LLM.from_pretrained(tiny_checkpoint("c32-window")), None)
    assert 4 in seen and -3 in seen  # steps of 3 canvases ran in bucket 4
    assert all(len(pointers) == 1 for pointers in seen.values()), seen
    fake = EagerCapture()
    replayed, seen = _generate(LLM.from_pretrained(tiny_checkpoint("c32-window")), fake)
    assert fake.replays > 0 and 4 * 32 in fake.captured  # the whole bucket, dummy row included
    # the sampler's graphs: the canvas inputs (ids first) and the update (slots first) of the
    # whole bucket; its rows' state written eager (a dummy row's slot is a real request's)
    sampler = fake.parts[1]
    assert sampler.replays > 0 and sorted(sampler.captured) == [4, 4 * 32]
    assert all(len(pointers) == 1 for pointers in seen.values()), seen
    assert replayed == eager


def test_logits_processors_and_pinned_tokens_run_with_the_sampler_graphs(
    tiny_checkpoint: Callable[[str], Path],
) -> None:
    """The logits processors rewrite the graph's static logits before its update replays; a
    hybrid canvas's pinned first token sends the step's canvas inputs and update eager. Same
    tokens as without graphs."""

    def generate(graphs: EagerCapture | None) -> list[list[int]]:
        llm = LLM.from_pretrained(tiny_checkpoint("c32-window"))
        if graphs is not None:
            fake_graphs(llm.engine, graphs)
        common = {"seed": 3, "max_tokens": 24, "max_denoising_steps": 4, "ignore_eos": True}
        params = [
            SamplingParams(mode=DecodeMode.DIFFUSION, logit_bias={7: 5.0, 9: -3.0}, **common),
            SamplingParams(mode=DecodeMode.DIFFUSION, presence_penalty=1.5, **common),
        ]
        hybrid = [SamplingParams(mode=DecodeMode.HYBRID, **common)]
        first = llm.generate([[5, 6, 7], [8, 9]], params)
        return [o.output_ids for o in first + llm.generate([[5, 6, 7]], hybrid)]

    fake = EagerCapture()
    assert generate(fake) == generate(None)
    assert fake.parts[1].replays > 0


def test_warm_up_captures_every_bucket_largest_first_into_the_graphs(
    tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=5))
    llm = LLM.from_pretrained(tiny_checkpoint("c32-window"), config=config)
    runner, fake = llm.engine.runner, EagerCapture()
    runner.graphs = ForwardGraphs(fake, runner.inputs, runner.model, runner.cache)
    monkeypatch.setattr(warmup, "_round", lambda *args, **kwargs: True)  # no requests
    warmup.warm_up(llm.engine)
    assert fake.captured == [5 * 32, 4 * 32, 2 * 32, 32]


def test_cuda_graphs_need_a_cuda_device(tiny_checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="--cuda-graphs .*need a CUDA device, not cpu"):
        LLM.from_pretrained(tiny_checkpoint("c32-window"), config=EngineConfig(cuda_graphs=True))
