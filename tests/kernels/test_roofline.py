"""The roofline's accountant (`loadtest.gpu.accountant`) and its dry run: FLOPs and bytes of an op,
host synchronisations and copies from pageable memory caught on the meta device, and the
fast-numerics step (forward, head, sampler) at the real shapes on meta, whose forward and
sampler must not synchronise, which copies from pinned memory only, and whose inputs' host
work does not grow with the context; with FP8 weights, the FP8 kernels' bytes."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.device import cuda
from engine.logits.processors import token_counts
from engine.model.config import LayerType
from engine.model.kv_cache import PagedKVCache
from kernels import resolve_kernels
from loadtest.gpu import roofline
from loadtest.gpu.accountant import H200, Accountant
from loadtest.gpu.bench import model_config

META = torch.device("meta")


def test_a_gemm_counts_its_flops_and_bytes_and_a_view_moves_nothing() -> None:
    a, b = torch.empty(64, 32, device=META), torch.empty(32, 16, device=META)
    acct = Accountant("meta")
    with acct:
        (a @ b).view(-1)
    (mm,) = [r for r in acct.records if r.launches]
    assert mm.flops == 2 * 64 * 32 * 16 and mm.gemm and mm.fp32
    assert mm.bytes == (64 * 32 + 32 * 16 + 64 * 16) * 4
    assert acct.launches == 1 and acct.seconds(H200) > 0


def test_the_cpu_twins_grouped_gemms_and_attention_count_their_flops() -> None:
    """The CPU calibration runs the twins: `_grouped_mm` and SDPA are not in torch's FLOP
    registry, and counted as bytes alone they made the CPU prediction half the measured step."""
    x, w = torch.randn(12, 16), torch.randn(3, 16, 8)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8)
    acct = Accountant("cpu")
    with acct:
        torch.nn.functional.grouped_mm(x, w, offs=torch.tensor([4, 8, 12], dtype=torch.int32))
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    flops = {r.name: r for r in acct.records if r.flops}
    assert flops["_grouped_mm"].flops == 2 * 12 * 16 * 8 and flops["_grouped_mm"].gemm
    (attention,) = [r for r in acct.records if r.attention]
    assert attention.flops == 4 * 2 * 4 * 5 * 7 * 8
    slow = dataclasses.replace(H200, attention_flops=1e9)
    assert attention.seconds(slow) > attention.seconds(H200)  # its own rate where measured


def test_syncs_are_recorded_on_meta_and_the_step_runs_on() -> None:
    x = torch.empty(8, device=META)
    acct = Accountant("meta")
    with acct:
        assert x.nonzero().shape == (8, 1)  # an upper bound stands in for the unknown shape
        x.sum().item()
        torch.tensor([1, 2]).to(META)
        torch.tensor([1, 2]).to(META, non_blocking=True)
        torch.tensor([1, 2], device=META)
        x.to("cpu")
    kinds = [r.sync for r in acct.syncs()]
    assert kinds == [
        "data-dependent shape",
        "value to host",
        "blocking host to device copy",
        "blocking host to device copy",
        "device to host copy",
    ]
    assert all(r.where.startswith("?") or r.where for r in acct.syncs())


@pytest.mark.parametrize("kind", roofline.KINDS)
def test_a_fast_step_has_no_host_sync_inside_the_forward_or_the_sampler(kind: str) -> None:
    """Allowed outside them: the step's one copy of its results to the host (`to_host`, after
    the sampler). The inputs move without blocking (`PagedRows.build`: one non-blocking copy
    of every column; it made five blocking `torch.tensor(..., device=)` copies per pool kind)."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    model = roofline.build(model_config(toy=True), kernels, META)
    step = roofline.account(model, kind, 2)
    assert step.acct.syncs(("forward", "sampler")) == []
    assert step.acct.pageable_copies() == []
    assert any(r.copy == "pinned" and r.phase == "inputs" for r in step.acct.records)
    outside = [(r.phase, r.sync) for r in step.acct.syncs()]
    assert outside in ([], [("publish", "device to host copy")]), outside
    assert step.acct.launches > 0 and step.acct.gemm_flops > 0


def test_the_roofline_dry_run_prints_predictions_at_the_real_shapes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        roofline.main(["--canvases", "1", "--layers", "6", "--kinds", "denoise", "--top", "3"]) == 0
    )
    out = capsys.readouterr().out
    assert "from pinned memory, 0 from pageable memory" in out
    assert "Inputs-phase host work, denoise at 16 canvases" in out
    assert "independent of context" in out
    assert "| denoise | 1 |" in out and "×floor" in out and "Top ops" in out
    row = next(line for line in out.splitlines() if line.startswith("| denoise | 1 |"))
    assert row.endswith("(0) |"), row  # no sync inside the forward and the sampler


def test_copies_from_pageable_memory_are_flagged_and_staged_ones_are_not() -> None:
    """On CUDA a `host_buffer` is pinned and `to_device` stages through one; anything else a
    copy to the device reads is pageable (CUDA may make the copy wait for the stream)."""
    acct = Accountant("meta")
    with acct:
        with acct.phase("inputs"):
            torch.tensor([1, 2, 3]).to(META, non_blocking=True)
            torch.from_numpy(np.arange(4)).to(META)
            torch.tensor([1.0], device=META)
        with acct.phase("sampler"):
            staged = cuda.host_buffer((4,), torch.int64, META).fill_(3)
            staged.to(META, non_blocking=True)
            torch.empty(3, dtype=torch.int64, device=META).copy_(staged[1:], non_blocking=True)
            cuda.to_device(np.arange(5), META)
    pageable = [(r.phase, r.host_bytes) for r in acct.pageable_copies()]
    assert pageable == [("inputs", 24), ("inputs", 32), ("inputs", 4)]
    assert [r.phase for r in acct.records if r.copy == "pinned"] == ["sampler"] * 3
    assert cuda.STAGING_OBSERVERS == []  # serving never pays for the accountant's hook


def test_the_penalties_and_the_sliding_page_copies_copy_from_pinned_memory() -> None:
    cache = PagedKVCache(
        model_config(toy=True).text, dict.fromkeys(LayerType, 4), 16, torch.bfloat16, META
    )
    acct = Accountant("meta")
    with acct:
        request = SimpleNamespace(prompt_ids=[1, 2, 3], output_ids=[3, 4, 4], penalty_tokens=None)
        counts = token_counts(request, META)  # type: ignore[arg-type]
        cache.copy_pages(LayerType.SLIDING, [0, 1], [2, 3])
    assert counts.seen.device == META and counts.counts.dtype == torch.float32
    assert acct.pageable_copies() == []
    assert sum(r.copy == "pinned" for r in acct.records) == 5


def test_the_inputs_host_work_of_a_step_does_not_grow_with_its_context() -> None:
    """The runner's device page tables hold running sequences' tables: a step copies a row
    of them only when a sequence's tables change (then its whole table, which grows)."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    model = roofline.build(model_config(toy=True), kernels, META)
    work = [roofline.inputs_work(model, "denoise", 3, n) for n in (256, 4096)]
    assert work[0].ops == work[1].ops and work[0].host_bytes == work[1].host_bytes > 0
    assert work[0].rows_written == work[1].rows_written == 0
    assert "independent of context" in roofline.context_line("denoise", 3, work)

    def changed(prefix: int) -> tuple[int, float]:
        harness = roofline.StepHarness(model, "denoise", 3, META, prefix)
        for tables in harness.pages:  # e.g. a ring slot swapped: the row is written again
            tables.version += 1
        acct = Accountant("meta")
        with torch.inference_mode():
            harness.run(acct)
        return acct.host_work("inputs")

    short, long = changed(256), changed(4096)
    assert long[1] - short[1] >= 3 * (4096 - 256) // roofline.PAGE_SIZE * 4  # int32 entries


def test_an_fp8_step_streams_fp8_weights_through_the_fp8_kernels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--quantization fp8`: the projections and experts run as `canvas::fp8_linear` (a
    per-token quantization, then `_scaled_mm` over one byte a weight) and `canvas::fp8_moe`
    (the experts' FP8 bytes and scales), never a dequantized weight; the step's weight bytes
    are about half of bf16's."""
    kernels = resolve_kernels("cpu", "twins").with_custom_ops()
    config = model_config(toy=True)
    bf16 = roofline.account(roofline.build(config, kernels, META), "denoise", 1)
    model = roofline.build(config, kernels, META, "fp8")
    fp8 = roofline.account(model, "denoise", 1)
    names = {r.name for r in fp8.acct.records}
    assert {"canvas.fp8_linear.quantize_rows", "canvas.fp8_linear.scaled_mm"} <= names
    assert "canvas.fp8_moe.expert_gemms" in names and "canvas.fused_moe.expert_gemms" not in names
    linears = [r for r in fp8.acct.records if r.name == "linear" and r.phase == "forward"]
    assert len(linears) == 1  # the head alone: no projection dequantizes its weight
    assert 0.45 < fp8.weight_bytes / bf16.weight_bytes < 0.75  # embedding and head stay bf16
    gemms = [r for r in fp8.acct.records if r.name == "canvas.fp8_moe.expert_gemms"]
    plain = [r for r in bf16.acct.records if r.name == "canvas.fused_moe.expert_gemms"]
    assert sum(r.bytes for r in gemms) < 0.7 * sum(r.bytes for r in plain)
    assert roofline.main(["--canvases", "1", "--layers", "2", "--kinds", "denoise",
                          "--quantization", "fp8", "--contexts", "2048"]) == 0  # fmt: skip
    assert "FP8 projections and experts" in capsys.readouterr().out
