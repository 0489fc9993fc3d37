"""The GPU benchmark script: its help, its refusal without a GPU, and a dry run of the whole
flow (ceilings, every kernel, a full denoising step) on CPU at toy shapes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "loadtest" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gpu_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_help_names_the_dry_run(gpu_bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_bench.main(["--help"])
    assert exit_info.value.code == 0
    assert "--dry-run" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_points_to_the_dry_run(
    gpu_bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_bench.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_dry_run_times_every_kernel_and_a_step(
    gpu_bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_bench.main(["--dry-run", "--canvases", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("attention sliding", "attention full", "route_experts", "fused_moe",
                 "fused_sample", "entropy_accept", "soft_embedding", "step"):  # fmt: skip
        assert name in out


def test_real_shapes_hold_the_26b_weights(gpu_bench: ModuleType) -> None:
    from kernels import reference

    bench = gpu_bench.Bench(torch.device("meta"), torch.bfloat16, reference, iters=1)
    model = gpu_bench.Model(bench, gpu_bench.Shapes())
    assert abs(model.weight_bytes() / 2 - 25.2e9) < 0.1e9
    assert [model.s.is_full(i) for i in range(30)].count(True) == 5
