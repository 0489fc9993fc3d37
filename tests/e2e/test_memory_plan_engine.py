"""The engine allocates what its memory plan says (`Engine.plan`), and a start whose plan
cannot hold one canvas fails naming the flags."""

from __future__ import annotations

from dataclasses import replace

import pytest

import engine.engine
from engine.build import BuildConfig, CheckpointConfig, build
from engine.device.memory import (
    CPU_KV_CACHE_TOKENS,
    DeviceMemory,
    MemoryConfig,
    MemoryPlanError,
)
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.model.config import LayerType
from engine.params import DecodeMode, SamplingParams
from engine.validation import ContextLengthError
from server.cli import main


def checkpoint(path) -> CheckpointConfig:
    return CheckpointConfig(path, device="cpu", kernels="twins", adapter=False)


def pool_bytes(engine_: engine.engine.Engine) -> int:
    cache = engine_.runner.cache
    return sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))


def test_the_engine_allocates_what_its_plan_says(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("c16")
    _, roomy = build(BuildConfig(checkpoint(path)))
    per_request = roomy.plan.kv_bytes // 64  # the tiny model's rings and full KV, per request
    # A device with room for a few running requests only: the plan, not the flags, sizes it.
    small = DeviceMemory("test device", 10 * per_request + roomy.plan.step_bytes, 0)
    monkeypatch.setattr(engine.engine, "device_memory", lambda device: small)
    config = EngineConfig(memory=MemoryConfig(gpu_memory_utilization=1.0, max_model_len=1024))
    _, built = build(BuildConfig(checkpoint(path), config))
    plan = built.plan
    assert 1 <= plan.max_running_requests < 64 and plan.limited_by == "memory"
    assert built.scheduler.config.max_num_seqs == plan.max_running_requests
    assert built.scheduler.slots.num_pages == plan.max_running_requests
    assert built.scheduler.config.max_num_batched_tokens == plan.tokens_per_step
    assert built.pages.full.num_pages == plan.full_pages
    assert built.pages.sliding.num_pages == plan.sliding_pages
    assert pool_bytes(built) == plan.kv_bytes
    assert [t.shape[0] for t in built.runner.cache.keys] == [
        plan.full_pages if kind is LayerType.FULL else plan.sliding_pages
        for kind in built.runner.cache.layer_types
    ]
    assert built.limits.max_context_positions == 1024 == plan.max_model_len
    assert built.limits.max_num_seqs == plan.max_running_requests


def test_the_runners_page_tables_are_as_wide_as_the_served_context(tiny_checkpoint):
    """--max-model-len, not the model's max_position_embeddings (8,192 here), sizes the device
    page tables and the all-denoise buckets' (a CUDA graph's capture width): a request at the
    limit runs in them without widening them; one past it is refused as before."""
    config = EngineConfig(memory=MemoryConfig(max_model_len=100))
    llm = LLM.from_config(BuildConfig(checkpoint(tiny_checkpoint("c16")), config))
    runner, pages = llm.engine.runner, -(-100 // llm.engine.config.page_size)
    assert llm.engine.plan.max_model_len == 100 and pages == 7
    tables = runner.tables
    assert {t.shape[1] for t in (*tables.host.values(), *tables.table.values())} == {pages}
    params = SamplingParams(
        mode=DecodeMode.DIFFUSION, max_tokens=96, max_denoising_steps=2, ignore_eos=True
    )
    [out] = llm.generate([[5, 6, 7, 8]], params)  # 4 + 96 positions: every column
    assert len(out.output_ids) == 96
    assert runner.inputs.buckets, "the canvases ran in a bucket"
    widths = {t.shape[1] for b in runner.inputs.buckets.values() for t in b.pages.values()}
    assert tables.max_pages == pages and widths == {pages}
    with pytest.raises(ContextLengthError, match="context of 100"):
        llm.generate([[5, 6, 7, 8, 9]], params)


def test_a_bf16_cpu_plan_holds_the_kernels_copies_of_the_dense_weights(tiny_checkpoint):
    """The native bf16 kernels copy each dense projection weight once (reordered for oneDNN or
    packed for the tiles) at its first use, after the plan: the plan leaves out what those
    copies hold, and a generate leaves exactly that much in the binding's store."""
    config = CheckpointConfig(tiny_checkpoint("c16"), "bfloat16", "cpu", kernels="native")
    llm = LLM.from_config(BuildConfig(config, EngineConfig()))
    plan = llm.engine.plan
    assert plan.packed_bytes > 0 and "CPU kernels' copies" in plan.describe()
    assert plan.as_json()["packed_bytes"] == plan.packed_bytes
    usable = int(plan.gpu_memory_utilization * plan.total_bytes) - plan.packed_bytes
    assert plan.usable_bytes == usable  # a CPU's weights are already out of its available RAM
    params = SamplingParams(mode=DecodeMode.DIFFUSION, max_tokens=16, max_denoising_steps=2)
    llm.generate([[5, 6, 7, 8]], params)
    packs = llm.model.kernels.linear.keywords["packs"]  # the binding's store (`bind_packed`)
    others = {"bf16_experts", "router", "router_scales"}  # experts' and router's: not counted
    dense = [c for key, (_, _, c) in packs.copies.items() if key[0] not in others]
    held = sum(t.numel() * t.element_size() for copies in dense for t in copies)
    assert {key[0] for key in packs.copies} - others  # dense copies made
    assert held == plan.packed_bytes
    fp32 = replace(config, dtype="float32")
    assert LLM.from_config(BuildConfig(fp32, EngineConfig())).engine.plan.packed_bytes == 0


def test_a_cpu_engine_keeps_todays_pools_for_a_small_model(tiny_checkpoint):
    _, built = build(BuildConfig(checkpoint(tiny_checkpoint("c16"))))
    assert built.scheduler.config == EngineConfig().scheduler
    assert built.pages.full.num_pages * 16 == CPU_KV_CACHE_TOKENS
    assert built.limits.max_context_positions == built.model.cfg.max_position_embeddings


def test_an_engine_whose_plan_cannot_hold_one_canvas_does_not_start(tiny_checkpoint):
    config = EngineConfig(memory=MemoryConfig(gpu_memory_utilization=1e-12))
    with pytest.raises(MemoryPlanError, match="cannot hold one canvas") as info:
        build(BuildConfig(checkpoint(tiny_checkpoint("c16")), config))
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--max-num-seqs"):
        assert flag in str(info.value)


def test_serve_stops_at_start_naming_the_flags(tiny_checkpoint, capsys):
    args = ["serve", "--model", str(tiny_checkpoint("c16")), "--port", "0", "--threads", "1"]
    args += ["--device", "cpu", "--kernels", "twins", "--gpu-memory-utilization", "1e-12"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("canvas serve: error: the memory plan cannot hold one canvas")
    assert "--gpu-memory-utilization" in err and "--max-model-len" in err
