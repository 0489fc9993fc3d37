"""The memory plan (`engine.device.memory`) at the real 26B-A4B shapes, built on the meta
device (nothing allocated), `canvas plan`'s output, and the README's table against it."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import engine.device.memory
from engine.checkpoints.tiny import (
    PRESETS,
    REAL_26B_A4B_CANVAS_LENGTH,
    REAL_26B_A4B_TEXT_CONFIG,
    estimate_parameters,
    preset_text_config,
)
from engine.device.memory import (
    CPU_KV_CACHE_TOKENS,
    GPUS,
    DeviceMemory,
    MemoryConfig,
    MemoryPlanError,
    ModelShapes,
    assumed_gpu,
    available_ram,
    device_memory,
    graph_pool_bytes,
    meta_model,
    model_shapes,
    plan_memory,
    step_transient,
)
from engine.engine import EngineConfig
from engine.model.config import LayerType, ModelConfig, parse_text_config
from engine.scheduler import SchedulerConfig
from kernels import resolve_kernels
from server.cli import main

ROOT = Path(__file__).resolve().parents[2]
GB = 10**9


@functools.cache
def real_shapes() -> ModelShapes:
    text = parse_text_config(dict(REAL_26B_A4B_TEXT_CONFIG))
    config = ModelConfig("diffusion_gemma", text, REAL_26B_A4B_CANVAS_LENGTH, "bfloat16")
    return model_shapes(meta_model(config, torch.bfloat16))


def at(max_model_len: int | None = None, **scheduler: int) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(**scheduler), memory=MemoryConfig(max_model_len=max_model_len)
    )


def test_real_shapes_count_the_weights_and_kv_from_the_config():
    shapes = real_shapes()
    parameters = estimate_parameters(REAL_26B_A4B_TEXT_CONFIG).total
    # bf16 parameters, plus the buffers (layer scalars: a few hundred bytes)
    assert 0 <= shapes.weights_bytes - 2 * parameters < 1024
    assert round(shapes.weights_bytes / GB, 1) == 50.5
    # 25 sliding layers of 8 KV heads of 256, 5 full layers of 2 of 512; K and V, bf16.
    assert shapes.kv_bytes_per_position == {
        LayerType.SLIDING: 25 * 8 * 256 * 2 * 2,
        LayerType.FULL: 5 * 2 * 512 * 2 * 2,
    }
    vocab = REAL_26B_A4B_TEXT_CONFIG["vocab_size"]
    assert shapes.logit_bytes == (4 + 2) * vocab  # fp32 logits and the bf16 head output
    # the in-place filters' chunk of 2^24 logits at 25 bytes each, and one canvas's raw logits
    assert shapes.filter_bytes == 25 * min(1 << 24, 256 * vocab) + 4 * 256 * vocab


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("max_model_len", [8192, 32768])
def test_the_plan_fits_its_device_and_no_larger_plan_does(gpu, max_model_len):
    shapes = real_shapes()
    plan = plan_memory(shapes, at(max_model_len), assumed_gpu(gpu, shapes.weights_bytes))
    page, running = plan.geometry.page_size, plan.max_running_requests
    ring = plan.geometry.sliding_ring(max_model_len)
    assert ring == 193  # the window (1,023) and a 2,048-token prefill chunk, in pages of 16
    assert plan.kv_positions["sliding"] == running * ring * page
    assert plan.kv_positions["full"] >= running * max_model_len
    kv = shapes.kv_bytes_per_position
    positions = plan.kv_positions
    assert plan.kv_bytes == sum(positions[t.name.lower()] * kv[t] for t in kv)
    assert plan.step_bytes + plan.kv_bytes + plan.slot_bytes <= plan.usable_bytes
    per_request = ring * page * kv[LayerType.SLIDING] + max_model_len * kv[LayerType.FULL]
    per_request += shapes.slot_bytes
    if plan.limited_by == "memory":  # one more request does not fit
        assert plan.step_bytes + (running + 1) * per_request > plan.usable_bytes
    canvases = plan.canvases_per_step
    assert canvases <= running and plan.tokens_per_step >= canvases * 256
    if canvases < 32:  # one more canvas per step leaves room for fewer running requests
        bigger = step_transient(shapes, (canvases + 1) * 256, 64)
        assert bigger + (canvases + 1) * per_request > plan.usable_bytes


def test_one_h100_holds_16_canvases_at_8k_and_one_h200_64():
    shapes = real_shapes()
    h100 = plan_memory(shapes, at(8192), assumed_gpu("h100", shapes.weights_bytes))
    h200 = plan_memory(shapes, at(8192), assumed_gpu("h200", shapes.weights_bytes))
    assert h100.max_running_requests >= 16 and h100.canvases_per_step >= 16
    assert h200.max_running_requests == 64 and h200.limited_by == "--max-num-seqs"


def test_cuda_graphs_pools_are_counted_and_one_h100_still_holds_16_canvases_at_8k(capsys):
    """--cuda-graphs: the pools' bytes (the largest bucket's forward activations, and the fp32
    logits of each bucket of at most HEAD_ROWS canvases, whose graphs hold the head and the
    sampler) come out of the step's room before the running requests are counted."""
    shapes = real_shapes()
    gpu = assumed_gpu("h100", shapes.weights_bytes)
    eager = plan_memory(shapes, at(8192), gpu)
    graphed = plan_memory(shapes, replace(at(8192), cuda_graphs=True), gpu)
    logits = (1 + 2 + 4) * shapes.canvas_length * 4 * shapes.text.vocab_size
    canvases = graphed.canvases_per_step
    assert graphed.graph_bytes == graph_pool_bytes(shapes, 64, canvases) > logits
    step = step_transient(shapes, graphed.tokens_per_step, 64)
    assert graphed.step_bytes == step + graphed.graph_bytes
    assert eager.graph_bytes == 0 and graphed.max_running_requests < eager.max_running_requests
    assert graphed.max_running_requests >= 16 and canvases >= 16
    assert "GB of it CUDA graphs'" in graphed.describe()
    args = ("--preset", "real-26b-a4b", "--gpu", "h100", "--max-model-len", "8192")
    assert plan_json(capsys, *args, "--cuda-graphs")["graph_bytes"] == graphed.graph_bytes
    assert main(["plan", *args, "--cuda-graphs"]) == 0
    assert "GB of it CUDA graphs'" in capsys.readouterr().out
    # the largest bucket a step uses sizes the forward's part; above HEAD_ROWS, no logits
    assert graph_pool_bytes(shapes, 64, 9) == graph_pool_bytes(shapes, 64, 16)
    grown = graph_pool_bytes(shapes, 64, 8) - graph_pool_bytes(shapes, 64, 4)
    assert 0 < grown < 4 * 256 * shapes.token_bytes + 8 * 256 * 12_000
    # AR rows' graphs, one per bucket of up to max_rows rows: their logits up to HEAD_ROWS rows
    # and hidden states above, and their activations once their tokens outnumber the canvases'
    hidden = shapes.text.hidden_size * shapes.dtype_bytes
    ar = graph_pool_bytes(shapes, 8, 1) - graph_pool_bytes(shapes, 4, 1)
    assert ar == 8 * hidden
    length = shapes.canvas_length
    many = graph_pool_bytes(shapes, 2 * length, 1) - graph_pool_bytes(shapes, length, 1)
    assert many == 2 * length * hidden + length * shapes.token_bytes
    assert graph_pool_bytes(shapes, 1, 1) >= 4 * shapes.text.vocab_size * (1 + length)


def test_a_plan_that_cannot_hold_one_canvas_names_the_flags():
    shapes = real_shapes()
    config = replace(at(), memory=MemoryConfig(gpu_memory_utilization=0.6))
    with pytest.raises(MemoryPlanError) as info:
        plan_memory(shapes, config, assumed_gpu("h100", shapes.weights_bytes))
    for flag in ("--gpu-memory-utilization 0.6", "--max-model-len 262144", "--max-num-seqs"):
        assert flag in str(info.value)
    with pytest.raises(MemoryPlanError, match="--max-model-len 300000 exceeds"):
        plan_memory(shapes, at(300_000), assumed_gpu("h200", shapes.weights_bytes))
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be in"):
        MemoryConfig(gpu_memory_utilization=1.5)


def test_a_cpu_plan_leaves_out_the_bf16_kernels_copies_of_the_dense_weights():
    """The real model bound to the native CPU kernels in bf16 holds one copy of each dense
    projection (reordered for oneDNN: ~3.3 GB beside 50.5 GB) once it has run: the plan shares
    out that much less, and says so; under other kernels (a GPU's) there are none."""
    assert real_shapes().packed_bytes == 0
    text = parse_text_config(dict(REAL_26B_A4B_TEXT_CONFIG))
    config = ModelConfig("diffusion_gemma", text, REAL_26B_A4B_CANVAS_LENGTH, "bfloat16")
    model = meta_model(config, torch.bfloat16)
    model.bind_kernels(resolve_kernels("cpu", "native"))
    shapes = model_shapes(model)
    hidden, heads, inter = text.hidden_size, text.num_heads, text.intermediate_size
    attention = sum(
        (2 * heads + (1 + spec.has_v_proj) * spec.num_kv_heads) * spec.head_dim * hidden
        for spec in text.layers
    )
    mlps = (text.num_layers + 1) * 3 * inter * hidden  # and the self-conditioning block's
    assert shapes.packed_bytes == 2 * (attention + mlps)
    assert round(shapes.packed_bytes / GB, 1) == 3.3
    host = DeviceMemory("cpu", 200 * GB, 0, host=True)
    plan = plan_memory(shapes, at(8192), host)
    assert plan_memory(replace(shapes, packed_bytes=0), at(8192), host).usable_bytes == (
        plan.usable_bytes + shapes.packed_bytes
    )
    assert "their CPU kernels' copies 3.3 GB" in plan.describe()
    gpu = plan_memory(real_shapes(), at(8192), assumed_gpu("h100", shapes.weights_bytes))
    assert gpu.packed_bytes == 0 and "copies" not in gpu.describe()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_cpu_plan_keeps_the_small_model_defaults(preset):
    """On a CPU with 8 GB available, a small model gets the pools it always had: 64 running
    requests with a ring each, 131,072 full-attention positions, 8,192 tokens per step."""
    text = parse_text_config(preset_text_config(preset))
    shapes = model_shapes(meta_model(ModelConfig("diffusion_gemma", text, 16, None), torch.float32))
    plan = plan_memory(shapes, EngineConfig(), DeviceMemory("cpu", 8 * GB, 0, host=True))
    assert plan.max_running_requests == 64 and plan.canvases_per_step == min(64, 8192 // 16)
    assert plan.kv_positions["full"] == CPU_KV_CACHE_TOKENS and plan.tokens_per_step == 8192
    ring = plan.geometry.sliding_ring(text.max_position_embeddings)
    assert plan.sliding_pages == 64 * ring


def test_an_explicit_kv_cache_is_kept_and_the_running_requests_fit_beside_it():
    shapes = real_shapes()
    config = replace(at(8192), kv_cache_tokens=131_072)
    plan = plan_memory(shapes, config, assumed_gpu("h200", shapes.weights_bytes))
    assert plan.kv_positions["full"] == 131_072 and plan.max_running_requests == 64
    huge = replace(config, kv_cache_tokens=5_000_000)  # 102 GB of full-attention KV
    with pytest.raises(MemoryPlanError, match="lower --kv-cache-tokens"):
        plan_memory(shapes, huge, assumed_gpu("h200", shapes.weights_bytes))


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_canvas_plan_prints_json_with_the_plans_numbers(capsys):
    out = plan_json(capsys, "--preset", "real-26b-a4b", "--gpu", "h100", "--max-model-len", "8192")
    shapes = real_shapes()
    plan = plan_memory(shapes, at(8192), assumed_gpu("h100", shapes.weights_bytes))
    assert out["weights_bytes"] == shapes.weights_bytes
    assert out["kv_positions"] == plan.kv_positions and set(out["kv_positions"]) == {
        "full",
        "sliding",
    }
    assert out["canvases_per_step"] == plan.canvases_per_step
    assert out["max_running_requests"] == plan.max_running_requests


def test_canvas_plan_reads_a_checkpoint_directorys_config(tmp_path, capsys):
    raw = {"model_type": "diffusion_gemma", "text_config": REAL_26B_A4B_TEXT_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16"}))
    common = ("--gpu", "h200", "--max-model-len", "32768")
    from_dir = plan_json(capsys, "--model", str(tmp_path), *common)
    assert from_dir == plan_json(capsys, "--preset", "real-26b-a4b", *common)
    halved = plan_json(capsys, "--model", str(tmp_path), *common, "--dtype", "float32")
    assert halved["weights_bytes"] == 2 * from_dir["weights_bytes"]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline (no test reaches the network)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_canvas_plan_reads_a_hub_ids_config_from_the_cache(hub_cache, capsys):
    repo = hub_cache / "models--google--diffusiongemma-26B-A4B-it"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    raw = {"model_type": "diffusion_gemma", "text_config": REAL_26B_A4B_TEXT_CONFIG}
    (snapshot / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16"}))
    common = ("--gpu", "h100", "--max-model-len", "8192")
    from_hub = plan_json(capsys, "--model", "google/diffusiongemma-26B-A4B-it", *common)
    assert from_hub == plan_json(capsys, "--preset", "real-26b-a4b", *common)


def test_canvas_plan_fails_naming_the_flags(hub_cache, capsys):
    args = ["plan", "--preset", "real-26b-a4b", "--gpu", "h100", "--gpu-memory-utilization", "0.5"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cannot hold one canvas" in err and "--gpu-memory-utilization 0.5" in err
    assert main(["plan", "--model", "no-such-org/no-such-model", "--gpu", "h100"]) == 2
    assert "--model no-such-org/no-such-model: no such directory" in capsys.readouterr().err


def readme_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Hardware and memory") : text.index("## API surface")]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| h")]
    return [[cell.strip() for cell in row] for row in rows]


def test_the_readme_memory_table_is_the_plans(capsys):
    rows = readme_rows()  # the Hopper GPUs the README serves on
    assert {row[0].split()[0] for row in rows} == {"h100", "h200"} <= set(GPUS)
    for gpu, max_model_len, running, canvases, positions, step in rows:
        gpu = gpu.split()[0]
        args = ("--preset", "real-26b-a4b", "--gpu", gpu, "--max-model-len", max_model_len)
        out = plan_json(capsys, *args)
        assert int(running) == out["max_running_requests"], (gpu, max_model_len)
        assert int(canvases) == out["canvases_per_step"], (gpu, max_model_len)
        full, sliding = (int(n.replace(",", "")) for n in positions.split(" / "))
        assert (full, sliding) == (out["kv_positions"]["full"], out["kv_positions"]["sliding"])
        assert step == f"{out['step_bytes'] / GB:.1f} GB"
    weights = f"({out['weights_bytes'] / GB:.1f} GB of text-stack weights)"
    assert weights in (ROOT / "README.md").read_text()


def test_a_cuda_device_is_measured_after_the_weights_load(monkeypatch):
    """CUDA's free memory after the weights: what is already taken is what the driver does not
    report free (the weights, the CUDA context), once the allocator's idle cache is given back."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    memory = device_memory(torch.device("cuda", 1))
    assert calls == ["empty_cache"] and not memory.host
    assert (memory.total_bytes, memory.taken_bytes) == (80 * GB, 50 * GB)
    assert memory.usable_bytes(0.9) == 22 * GB
    assert memory.name == "cuda:1 (NVIDIA H100 80GB HBM3)"


def test_a_cpu_is_measured_by_its_available_ram(monkeypatch):
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < available_ram() <= physical
    monkeypatch.setattr(engine.device.memory, "available_ram", lambda: 12 * GB)
    memory = device_memory(torch.device("cpu"))
    assert memory.host and (memory.total_bytes, memory.taken_bytes) == (12 * GB, 0)
