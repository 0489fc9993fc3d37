"""The engine on a CUDA GPU (marked gpu: `make gpu-check` runs them; skipped elsewhere).

A random-weight DiffusionGemma at the GPU benchmark's toy shape, built as the benchmark builds
the real one (meta device, random weights in place; no checkpoint, so no transformers):
1. the same packed forwards (two prefills, one past the sliding window; a canvas beside a
   commit; two canvases) on the Triton kernels and on the twins agree, pools included;
2. the engine serves requests that join mid-flight, so that steps mix prefill, denoise and
   commit rows, on both kernel sets: every canvas runs its fixed steps, every token is valid.
3. A tiny checkpoint loads onto the GPU and its forwards match the CPU's (needs transformers
   >= 5.23 to build it: carried as a wheel on the GPU machine, see loadtest/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.kv_pages import KVPages, PageGeometry
from engine.model import DiffusionLM, ForwardBatch, Mode, PagedKVCache, Row, load_model
from engine.model.config import LayerType
from engine.params import DecodingDefaults, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.types import StepOutput
from kernels import resolve_kernels, triton_available
from loadtest.gpu.bench import build_model, model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]
CUDA = torch.device("cuda")
PAGE = 16
NAMES = ("prefill", "canvas beside a commit", "canvas logits")


def toy_model(device: torch.device, dtype: torch.dtype, backend: str) -> DiffusionLM:
    return build_model(model_config(toy=True), device, dtype, backend)


@torch.inference_mode()
def forwards(model: DiffusionLM) -> list[torch.Tensor]:
    """Two prefills (one past the sliding window), a canvas beside a commit pass, then both
    canvases' logits; returns each output and every KV pool (fp32, on the CPU)."""
    cfg, length = model.cfg, model.config.canvas_length
    weight = model.embed_tokens.weight
    gen = torch.Generator().manual_seed(11)
    lens = [5, cfg.sliding_window + 7]
    context = max(lens) + 2 * length
    geometry = PageGeometry(PAGE, cfg.sliding_window, context, True, True)
    full, ring = 2 * geometry.full_pages(context), 2 * geometry.sliding_ring(context)
    pages = KVPages(geometry, full, ring)
    tables = [pages.allocate(context) for _ in range(2)]
    sizes = {LayerType.FULL: full, LayerType.SLIDING: ring}
    cache = PagedKVCache(cfg, sizes, PAGE, weight.dtype, weight.device)

    def row(seq: int, mode: Mode, start: int, num: int) -> Row:
        t = tables[seq]
        return Row(mode, start, num, {LayerType.FULL: t.full, LayerType.SLIDING: t.sliding()})

    def run(rows: list[Row], ids: torch.Tensor) -> torch.Tensor:
        batch = ForwardBatch(rows, cfg.sliding_window, PAGE)
        soft = [None] * sum(r.mode is Mode.DECODE for r in rows)
        return model(ids.to(weight.device), soft, batch, cache)

    prompts = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=gen)
    canvas = torch.randint(0, cfg.vocab_size, (2 * length,), generator=gen)
    outs = [run([row(i, Mode.ENCODE, 0, lens[i]) for i in range(2)], prompts)]
    outs.append(
        run([row(0, Mode.DECODE, lens[0], length), row(1, Mode.ENCODE, lens[1], length)], canvas)
    )
    starts = [lens[0], lens[1] + length]
    canvases = [row(i, Mode.DECODE, starts[i], length) for i in range(2)]
    outs.append(model.logits(run(canvases, canvas)))
    return [t.float().cpu() for t in outs + cache.keys + cache.values]


def assert_forwards_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        name = NAMES[i] if i < len(NAMES) else f"KV pool {i - len(NAMES)}"
        assert torch.isfinite(w).all(), name
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_forward_on_triton_kernels_matches_the_twins_on_cuda() -> None:
    model = toy_model(CUDA, torch.float32, "triton")
    assert model.layers[0].self_attn.kernels.backend == "triton"
    got = forwards(model)
    model.bind_kernels(resolve_kernels("cuda", "twins"))
    assert_forwards_close(got, forwards(model), tol=2e-3)


def serve(model: DiffusionLM, steps: int) -> tuple[dict[str, list[int]], list[StepOutput], bool]:
    """Three requests of two canvases each (prompts of 5, 40 and 70 tokens); the third joins
    after two steps. Returns tokens per request, the final outputs, and whether some step
    carried a prompt beside other rows."""
    cfg, length = model.cfg, model.config.canvas_length
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8 * length)
    engine = Engine(model, DecodingDefaults(), EngineConfig(sched, PAGE, 64 * PAGE))
    params = DecodingDefaults().resolve(
        SamplingParams(
            max_tokens=2 * length,
            seed=3,
            ignore_eos=True,
            max_denoising_steps=steps,
            confidence_threshold=0.0,
        )
    )
    gen = torch.Generator().manual_seed(5)
    prompts = {
        f"r{n}": torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 40, 70)
    }
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    finals, mixed = [], False
    for name in ("r5", "r40"):
        engine.add_request(name, prompts[name], params)
    for i in range(20 * steps):
        if i == 2:
            engine.add_request("r70", prompts["r70"], params)
        if not engine.has_work():
            break
        step = engine.step()
        for out in step.outputs:
            tokens[out.request_id] += out.new_token_ids
            finals += [out] if out.finish_reason else []
        last = step.stats
        mixed |= last.num_rows > 1 and last.num_tokens % length != 0
    return tokens, finals, mixed


@pytest.mark.parametrize("backend", ["triton", "twins"])
def test_engine_serves_requests_joining_mid_flight_on_cuda(backend: str) -> None:
    model = toy_model(CUDA, torch.bfloat16, backend)
    length, vocab = model.config.canvas_length, model.cfg.vocab_size
    tokens, finals, mixed = serve(model, steps=3)
    assert mixed, "no step carried a prompt beside other rows"
    assert sorted(o.request_id for o in finals) == ["r40", "r5", "r70"]
    for out in finals:
        assert out.finish_reason == "length" and out.stats is not None
        assert out.stats.steps_per_canvas == (3, 3), out.request_id
    for name, ids in tokens.items():
        assert len(ids) == 2 * length, name
        assert all(0 <= t < vocab for t in ids), name


def test_tiny_checkpoint_on_cuda_matches_the_cpu(tiny_checkpoint: Callable[[str], Path]) -> None:
    try:
        from transformers import DiffusionGemmaConfig  # noqa: F401
    except ImportError:
        pytest.skip(
            "building a tiny checkpoint needs transformers>=5.23: carry wheels/ "
            "(loadtest/README.md, GPU check)"
        )
    path = tiny_checkpoint("c16")
    want = forwards(load_model(path, kernels="twins"))
    got = forwards(load_model(path, device="cuda", kernels="triton"))
    assert_forwards_close(got, want, tol=2e-3)
