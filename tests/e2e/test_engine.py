"""The engine with many requests: batch invariance, mixed modes, abort."""

from __future__ import annotations

import torch

from engine import LLM, DecodeMode, SamplingParams
from engine.engine import EngineConfig
from engine.scheduler import SchedulerConfig


def run_together(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[dict, int]:
    """Submit all requests to the engine at once; return outputs and the widest step."""
    engine, outputs, widest = llm.engine, {}, 0
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, llm.defaults.resolve(p))
        outputs[f"r{i}"] = []
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        widest = max(widest, engine.last_step.num_rows)
    return outputs, widest


def test_concurrent_requests_give_exactly_their_one_at_a_time_outputs(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), exact=True)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (16,), generator=gen).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    params = [SamplingParams(max_tokens=10 + 7 * i, seed=100 + i) for i in range(16)]
    together, widest = run_together(llm, prompts, params)
    assert widest == 16  # they really shared forward passes
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        (alone,) = llm.generate(prompt, p)
        assert together[f"r{i}"] == alone.output_ids


def test_diffusion_and_ar_requests_share_steps(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c32-window"), exact=True)
    prompts = [[5, 6, 7], [8, 9], list(range(10, 50))]
    params = [
        SamplingParams(max_tokens=40, seed=1),
        SamplingParams(max_tokens=12, mode=DecodeMode.AR),
        SamplingParams(max_tokens=33, seed=2),
    ]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        assert out.output_ids == llm.generate(prompt, p)[0].output_ids


def test_finished_and_aborted_requests_return_their_pages(tiny_checkpoint):
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4), kv_cache_tokens=4096)
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), config=config)
    engine = llm.engine
    free = (engine.pages.full.num_free, engine.pages.sliding.num_free)
    llm.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=40, seed=0))
    assert (engine.pages.full.num_free, engine.pages.sliding.num_free) == free
    params = llm.defaults.resolve(SamplingParams(max_tokens=200, seed=0))
    engine.add_request("x", [5, 6, 7], params)
    engine.step()
    engine.step()
    assert engine.pages.usage() > 0 and engine.scheduler.num_running == 1
    assert engine.abort("x")
    assert (engine.pages.full.num_free, engine.pages.sliding.num_free) == free
    assert not engine.has_work() and engine.step() == []
