"""CUDA graphs of all-denoise forwards (`engine.device.graphs`) on a CUDA GPU (marked gpu:
`make gpu-check` runs them; skipped elsewhere, never faked): a tiny checkpoint on the Triton
kernels serves the same diffusion requests with `cuda_graphs` and with the same padded
forwards and sampler run eager (`tests.graph_cases.EagerCapture`: the same shapes, so the same
kernels; up to 4 canvases the graphs hold the head and sampler too), at step sizes that fill a
bucket and that leave dummy rows, and every token is the same; the graphs were captured for
every bucket at warm-up. The same for AR requests through the all-AR steps' graphs
(`engine.device.ar_steps`: forward and head up to 4 rows), greedy and sampled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.device.sampler_graphs import SamplerGraphs
from engine.device.warmup import warm_up
from engine.engine import EngineConfig
from engine.llm import LLM
from engine.params import DecodeMode, SamplingParams
from engine.scheduler import SchedulerConfig
from kernels import triton_available
from tests.graph_cases import EagerCapture, fake_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]


def _tokens(
    model_dir: Path, graphs: bool, num: int, mode: DecodeMode = DecodeMode.DIFFUSION, **extra: float
) -> tuple[list[list[int]], LLM]:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4), cuda_graphs=graphs)
    llm = LLM.from_pretrained(model_dir, device="cuda", kernels="triton", config=config)
    if graphs:
        warm_up(llm.engine)
    else:  # the padded forwards, eager
        fake_graphs(llm.engine, EagerCapture())
    params = [
        SamplingParams(
            mode=mode, seed=i, max_tokens=48, max_denoising_steps=6, ignore_eos=True, **extra
        )
        for i in range(num)
    ]
    outputs = llm.generate([[5 + i, 6, 7, 8 + i] for i in range(num)], params)
    return [o.output_ids for o in outputs], llm


@pytest.mark.parametrize("num", [1, 3, 4])
def test_replayed_denoise_forwards_give_the_eager_tokens(
    tiny_checkpoint: Callable[[str], Path], num: int
) -> None:
    model_dir = tiny_checkpoint("c32-window")
    eager, _ = _tokens(model_dir, False, num)
    replayed, llm = _tokens(model_dir, True, num)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    steps = llm.engine.sampling.steps  # type: ignore[attr-defined]
    assert isinstance(steps, SamplerGraphs) and (4 if num > 1 else 1) in steps.pairs
    assert replayed == eager


@pytest.mark.parametrize(("num", "temperature"), [(1, 0.0), (3, 0.0), (3, 1.0), (4, 1.0)])
def test_replayed_ar_forwards_give_the_eager_tokens(
    tiny_checkpoint: Callable[[str], Path], num: int, temperature: float
) -> None:
    model_dir = tiny_checkpoint("c32-window")
    eager, _ = _tokens(model_dir, False, num, DecodeMode.AR, temperature=temperature)
    replayed, llm = _tokens(model_dir, True, num, DecodeMode.AR, temperature=temperature)
    graphs = llm.engine.runner.ar.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    assert replayed == eager
