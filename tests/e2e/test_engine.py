"""The engine with many requests: batch invariance, mixed modes, abort."""

from __future__ import annotations

import pytest
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
        step = engine.step()
        for out in step.outputs:
            outputs[out.request_id] += out.new_token_ids
        widest = max(widest, step.stats.num_rows)
    return outputs, widest


def test_concurrent_requests_give_exactly_their_one_at_a_time_outputs(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), exact=True)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (16,), generator=gen).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
    # Budgets of 1 to 5 canvases, so requests leave the batch at different steps; a few
    # denoising steps per canvas (batch invariance does not depend on how many).
    params = [
        SamplingParams(max_tokens=6 + 4 * i, seed=100 + i, max_denoising_steps=4) for i in range(16)
    ]
    together, widest = run_together(llm, prompts, params)
    # They really shared forward passes: the 16 prompts' (a request's commit pass and its next
    # canvas's first step are two rows, so later steps may be wider).
    assert widest >= 16
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        (alone,) = llm.generate(prompt, p)
        assert together[f"r{i}"] == alone.output_ids


def test_diffusion_and_ar_requests_share_steps(tiny_checkpoint):
    llm = LLM.from_pretrained(tiny_checkpoint("c32-window"), exact=True)
    prompts = [[5, 6, 7], [8, 9], list(range(10, 50))]
    params = [
        SamplingParams(max_tokens=40, seed=1, max_denoising_steps=6),
        SamplingParams(max_tokens=12, mode=DecodeMode.AR),
        SamplingParams(max_tokens=33, seed=2, max_denoising_steps=6),
    ]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        assert out.output_ids == llm.generate(prompt, p)[0].output_ids


def test_finished_and_aborted_requests_return_their_pages(tiny_checkpoint):
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4), kv_cache_tokens=4096)
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), config=config)
    engine = llm.engine
    free = engine.pages.num_unheld()
    llm.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=40, seed=0, max_denoising_steps=4))
    assert engine.pages.num_unheld() == free
    params = llm.defaults.resolve(SamplingParams(max_tokens=200, seed=0))
    engine.add_request("x", [5, 6, 7], params)
    engine.step()
    engine.step()
    assert engine.pages.usage() > 0 and engine.scheduler.num_running == 1
    assert engine.abort("x")
    assert engine.pages.num_unheld() == free
    assert not engine.has_work() and engine.step().outputs == []


def _generate_all(engine, prompts, params):  # type: ignore[no-untyped-def]
    """Run requests r0.. to their ends; returns {id: (tokens, error)}."""
    results = {f"r{i}": ([], None) for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_work():
        for out in engine.step().outputs:
            tokens, _ = results[out.request_id]
            results[out.request_id] = (tokens + out.new_token_ids, out.error)
    return results


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_a_fault_in_one_requests_row_fails_only_that_request(tiny_checkpoint, exact):
    """A step that raises is re-run one row at a time: the request whose row fails again gets
    an error, every other request of the batch finishes normally."""
    llm = LLM.from_pretrained(tiny_checkpoint("c16"), exact=exact)
    engine, poison = llm.engine, 77
    execute = engine.runner.execute

    def faulty(step):  # type: ignore[no-untyped-def]
        if any(poison in e.tokens for e in step.encode):
            raise RuntimeError("injected fault")
        return execute(step)

    engine.runner.execute = faulty  # type: ignore[method-assign]
    params = llm.defaults.resolve(SamplingParams(max_tokens=20, seed=3, max_denoising_steps=4))
    results = _generate_all(engine, [[5, 6, 7], [8, poison, 9], [10, 11]], params)
    assert results["r1"] == ([], "internal engine error (RuntimeError)")
    for name in ("r0", "r2"):
        tokens, error = results[name]
        assert error is None and len(tokens) == 20
    assert not engine.requests and engine.pages.usage() == 0.0


def test_non_finite_logits_fail_only_their_request(tiny_checkpoint):
    """Fast numerics check every row's logits (their log-normaliser) for NaN and inf."""
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    engine = llm.engine
    execute = engine.runner.execute

    def nan_for_the_first_canvas(step):  # type: ignore[no-untyped-def]
        out = execute(step)
        if out.denoise_logits is not None and 60 in step.denoise_starts:
            row = step.denoise_starts.index(60) * engine.canvas_length
            with torch.inference_mode():
                out.denoise_logits[row : row + engine.canvas_length, 3] = float("nan")
        return out

    engine.runner.execute = nan_for_the_first_canvas  # type: ignore[method-assign]
    params = llm.defaults.resolve(SamplingParams(max_tokens=20, seed=3, max_denoising_steps=4))
    results = _generate_all(engine, [[5] * 60, [6, 7], [8, 9, 10]], params)
    assert results["r0"] == ([], "the model produced non-finite logits")
    assert all(results[n][1] is None and len(results[n][0]) == 20 for n in ("r1", "r2"))
    assert not engine.requests and engine.pages.usage() == 0.0


def test_steps_run_with_the_measured_thread_counts_and_give_the_same_tokens(tiny_checkpoint):
    """`EngineConfig.cpu_threads` (`canvas serve --threads auto`): the engine tries each count
    in turn, sets it in the thread that steps, and reports it per step; the count changes no
    token (fast numerics, on this checkpoint's shapes)."""
    import threading

    prompts = [[5, 6, 7], list(range(10, 40))]
    params = [SamplingParams(max_tokens=24, seed=i, max_denoising_steps=4) for i in range(2)]
    runs = {}
    for choices in ((), (1, 2)):
        llm = LLM.from_pretrained(tiny_checkpoint("c16"), config=EngineConfig(cpu_threads=choices))
        engine, seen, outputs = llm.engine, [], {}

        def loop(llm=llm, engine=engine, seen=seen, outputs=outputs) -> None:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                engine.add_request(f"r{i}", prompt, llm.defaults.resolve(p))
                outputs[f"r{i}"] = []
            while engine.has_work():
                step = engine.step()
                seen.append((step.stats.cpu_threads, torch.get_num_threads()))
                for out in step.outputs:
                    outputs[out.request_id] += out.new_token_ids

        worker = threading.Thread(target=loop)
        worker.start()
        worker.join()
        runs[choices] = outputs, seen
    assert {threads for threads, _ in runs[()][1]} == {0}  # no choices: torch's count alone
    seen = runs[(1, 2)][1]
    assert seen[0][0] == 2 and {threads for threads, _ in seen} == {1, 2}  # each tried
    assert all(threads == torch_threads for threads, torch_threads in seen)
    assert runs[(1, 2)][0] == runs[()][0]
    # Exact numerics are never measured (their bits depend on the count): torch's own count.
    exact = LLM.from_pretrained(
        tiny_checkpoint("c16"), exact=True, config=EngineConfig(cpu_threads=(1, 2))
    )
    assert exact.engine.threads is None
    (out,) = exact.generate(prompts[0], params[0])
    assert out.output_ids
