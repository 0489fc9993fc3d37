"""After the warm-up, serving compiles nothing new (marked gpu: `make gpu-check` runs it; skipped
elsewhere). A random-weight DiffusionGemma at the GPU benchmark's toy shape on the Triton
kernels: `engine.device.warmup` runs, then mixed requests (every mode, prompts of 1 to 133
tokens, logprobs, top-k and top-p, requests joining mid-flight, so steps of every mix and row
count) are served while Triton's `jit_cache_hook` counts every kernel it has to compile or
load (each new specialisation, whether its binary is on disk or not)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.device.warmup import warm_up
from engine.engine import Engine, EngineConfig
from engine.params import DecodeMode, DecodingDefaults, SamplingParams
from engine.scheduler import SchedulerConfig
from kernels import triton_available
from loadtest.gpu.bench import build_model, model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]
PROMPT_LENGTHS = (1, 5, 40, 70, 133)
MODES = (DecodeMode.DIFFUSION, DecodeMode.AR, DecodeMode.HYBRID)


def mixed_requests(length: int) -> list[tuple[int, SamplingParams]]:
    """(prompt length, parameters) of 15 requests: each mode with each prompt length, with
    logprobs, top-k, top-p and temperatures spread among them."""
    requests = []
    for i, (mode, n) in enumerate((m, n) for m in MODES for n in PROMPT_LENGTHS):
        params = SamplingParams(
            max_tokens=3 if i % 2 else length + 5,
            mode=mode,
            seed=i,
            ignore_eos=True,
            temperature=0.7 if i % 3 else 0.0,
            logprobs=2 if i % 4 == 0 else None,
            top_k=5 if i % 5 == 1 else None,
            top_p=0.9 if i % 5 == 2 else None,
        )
        requests.append((n, params))
    return requests


def serve_mixed(engine: Engine) -> set[str]:
    """Serve `mixed_requests`, three joining every other step; returns the ids that finished."""
    length, vocab = engine.canvas_length, engine.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    waiting = mixed_requests(length)
    added, finished = 0, set()
    for step in range(2000):
        if step % 2 == 0 and waiting:
            for n, params in waiting[:3]:
                prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
                engine.add_request(f"r{added}", prompt, engine.validator.resolve(n, params))
                added += 1
            waiting = waiting[3:]
        if not engine.has_work() and not waiting:
            break
        for out in engine.step().outputs:
            assert out.error is None, out.error
            finished |= {out.request_id} if out.finish_reason else set()
    return finished


def test_serving_after_the_warm_up_compiles_no_kernel() -> None:
    from triton import knobs

    model = build_model(model_config(toy=True), torch.device("cuda"), torch.bfloat16, "triton")
    length = model.config.canvas_length
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=4 * length)
    engine = Engine(model, DecodingDefaults(), EngineConfig(sched, 16, 1024 * 16))
    report = warm_up(engine)
    assert report.num_failed == 0 and report.num_steps > 0
    compiled: list[str] = []

    def count(*, fn: Any, **_: Any) -> bool:
        compiled.append(fn.name)
        return False  # compile as usual

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, count
    try:
        finished = serve_mixed(engine)
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert len(finished) == len(mixed_requests(length))
    assert compiled == [], f"compiled after the warm-up: {sorted(set(compiled))}"
