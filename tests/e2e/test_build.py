"""One build path (`engine.build`): `canvas serve`, `canvas generate`, `LLM`, training and the
GPU benchmark open checkpoints and build engines there, and alike for the same settings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import engine.build
from engine.build import BuildConfig, CheckpointConfig
from engine.engine import Engine, EngineConfig
from engine.llm import LLM
from engine.scheduler import SchedulerConfig
from server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SERVE_FLAGS = (
    *("--max-num-seqs", "3", "--max-queue", "5", "--kv-cache-tokens", "512"),
    *("--no-prefix-caching", "--threads", "1", "--kernels", "twins", "--adapter", "none"),
)


@pytest.fixture
def built(monkeypatch) -> list[Engine]:
    """Every engine `engine.build.build_engine` builds from now on, in order."""
    engines: list[Engine] = []

    class Recorded(Engine):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(engine.build, "Engine", Recorded)
    return engines


def test_serve_and_llm_build_the_same_engine_for_the_same_settings(tiny_checkpoint, built):
    from server.serve import build_state

    path = tiny_checkpoint("c16")
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--model", str(path), "--port", "0", *SERVE_FLAGS])
    state, banner = build_state(args)
    try:
        config = EngineConfig(
            scheduler=SchedulerConfig(max_num_seqs=3, max_queue=5),
            kv_cache_tokens=512,
            prefix_caching=False,
            cpu_threads=(1,),
        )
        llm = LLM.from_pretrained(path, device=args.device, config=config, kernels="twins")
        served = state.engine.engine  # type: ignore[attr-defined]
        assert built == [served, llm.engine]
        assert served.config == llm.engine.config == config
        assert served.model.kernels.describe() == llm.model.kernels.describe()
        assert served.defaults == llm.defaults and state.defaults == llm.defaults
        assert served.model.adapter is None and llm.model.adapter is None
        assert "cpu threads 1" in " ".join(banner)
    finally:
        state.engine.shutdown()


def test_generate_builds_what_llm_from_pretrained_builds(tiny_checkpoint, built, capsys):
    from server.cli import main

    path = tiny_checkpoint("c16")
    argv = ["generate", "--model", str(path), "--prompt-ids", "5,9", "--max-tokens", "4"]
    assert main([*argv, "--exact", "--kernels", "twins", "--json"]) == 0
    llm = LLM.from_pretrained(path, exact=True, kernels="twins")
    (generated, direct) = built
    assert generated.config == direct.config == EngineConfig()
    assert generated.model.kernels.describe() == direct.model.kernels.describe()
    assert '"numerics": "exact"' in capsys.readouterr().out
    assert llm.engine is direct


def test_llm_from_config_and_the_offline_constructor_build_through_engine_build(
    tiny_checkpoint, built
):
    path = tiny_checkpoint("c16")
    config = BuildConfig(CheckpointConfig(path, device="cpu"), EngineConfig(kv_cache_tokens=256))
    llm = LLM.from_config(config)
    again = LLM(llm.model, llm.tokenizer, llm.defaults)  # the trainer's distillation engine
    assert built == [llm.engine, again.engine]
    assert llm.engine.config.kv_cache_tokens == 256 and again.engine.config == EngineConfig()


def test_the_gpu_bench_builds_its_engine_through_engine_build(built):
    from loadtest.gpu import bench as gpu_bench

    model = gpu_bench.build_model(
        gpu_bench.model_config(toy=True), torch.device("cpu"), torch.float32, "twins"
    )
    assert built == [gpu_bench.make_engine(model, 2, 8)]


def calls_outside_build(name: str) -> list[str]:
    """Where serving code (engine/, server/, loadtest/) calls `name(...)` outside
    engine/build.py."""
    found = []
    for folder in ("engine", "server", "loadtest"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "engine" / "build.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                func = node.func if isinstance(node, ast.Call) else None
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if called == name:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_nothing_else_loads_a_checkpoint_or_constructs_an_engine():
    assert calls_outside_build("Engine") == []
    assert calls_outside_build("load_model") == []
