"""`make gpu-train`, the GPU command of the decoder adapter's recipe, dry-runs on CPU at toy
size: it converts (here: builds a tiny checkpoint), distills, trains, evaluates and brings back
at most 8 files of at most 16 MiB each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_gpu_train_command_dry_runs_on_cpu_at_toy_size(tmp_path):
    out = tmp_path / "gpu-out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            "make",
            "-C",
            str(ROOT),
            "gpu-train",
            f"PY={sys.executable}",
            f"GPU_OUT={out}",
            f"GPU_ARGS=--dry-run --work {tmp_path / 'work'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(
        [
            "adapter.safetensors",
            "adapter_config.json",
            "adapter_self_conditioning.safetensors",
            "eval.json",
            "loss_log.jsonl",
            "summary.json",
        ]
    )
    assert all((out / f).stat().st_size <= 16 << 20 for f in files)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["num_distilled"] > 25
    assert set(json.loads((out / "eval.json").read_text())["modes"]) == {"ar", "diffusion"}
    model = load_model(tmp_path / "work" / "tiny", adapter=out)
    assert model.adapter is not None and model.adapter.config.rank == 2
