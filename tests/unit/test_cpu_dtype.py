"""`--dtype auto` on the CPU (`engine.device.cpu_dtype`): bf16 where the CPU has AMX-bf16 and
the weights lose nothing in bf16, fp32 elsewhere; exact numerics, FP8, a GPU and a forced
`--dtype` keep theirs."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.build import CheckpointConfig, open_checkpoint
from engine.device import cpu_dtype
from engine.device.cpu_dtype import all_bf16_values, auto_dtype, choose_cpu_dtype, has_amx_bf16
from server.cli import build_parser
from server.cli.config import CHECKPOINT_FLAGS, build_config

AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})  # no AMX
PLAIN = frozenset({"avx2", "fma"})


def never() -> bool:
    raise AssertionError("called where it does not decide")


def test_amx_needs_the_flag_and_onednn_allowed_to_use_it():
    assert (
        has_amx_bf16(AMX, "") and has_amx_bf16(AMX, "all") and has_amx_bf16(AMX, "AVX512_CORE_AMX")
    )
    assert not has_amx_bf16(AMX, "AVX512_CORE_BF16")  # oneDNN capped below AMX
    assert not has_amx_bf16(AVX512_BF16, "") and not has_amx_bf16(PLAIN, "")


def test_a_bf16_checkpoint_runs_bf16_with_amx_and_fp32_without():
    choice = choose_cpu_dtype("bfloat16", AMX, "", never, never)
    assert choice.dtype == "bfloat16" and "AMX-bf16" in choice.reason
    for flags in (AVX512_BF16, PLAIN):
        choice = choose_cpu_dtype("bfloat16", flags, "", never, lambda: True)
        assert choice.dtype == "float32" and "no AMX-bf16" in choice.reason
    # fp32 weights that would not fit: the checkpoint's bf16 after all
    choice = choose_cpu_dtype("bfloat16", PLAIN, "", never, lambda: False)
    assert choice.dtype == "bfloat16" and "would not fit" in choice.reason


def test_an_fp32_checkpoint_runs_bf16_only_with_amx_and_weights_that_are_bf16_values():
    choice = choose_cpu_dtype("float32", AMX, "", lambda: True, never)
    assert choice.dtype == "bfloat16" and "exactly a bf16 value" in choice.reason
    choice = choose_cpu_dtype("float32", AMX, "", lambda: False, never)
    assert choice.dtype == "float32" and "not all bf16 values" in choice.reason
    for flags, isa in ((AVX512_BF16, ""), (PLAIN, ""), (AMX, "AVX512_CORE_BF16")):
        choice = choose_cpu_dtype("float32", flags, isa, never, never)
        assert choice.dtype == "float32" and "no AMX-bf16" in choice.reason
    assert choose_cpu_dtype("float16", AMX, "", never, never).dtype == "float16"


def test_bf16_values_are_found_by_their_low_bits(tmp_path: Path):
    exact = torch.randn(300, 7).to(torch.bfloat16).float()
    save_file({"a": torch.ones(3), "b": exact}, tmp_path / "exact.safetensors")
    assert all_bf16_values([tmp_path / "exact.safetensors"])
    inexact = exact.clone()
    inexact[299, 6] += 2.0**-20  # one value off the bf16 grid
    save_file({"a": torch.ones(3), "b": inexact}, tmp_path / "inexact.safetensors")
    assert not all_bf16_values([tmp_path / "exact.safetensors", tmp_path / "inexact.safetensors"])


@pytest.fixture
def bf16_valued(tiny_checkpoint, tmp_path: Path) -> Path:
    """The c16 checkpoint in fp32 with every weight rounded to a bf16 value."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("c16"), dst)
    weights = load_file(dst / "model.safetensors")
    rounded = {k: t.to(torch.bfloat16).float() for k, t in weights.items()}
    save_file(rounded, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_auto_on_an_amx_cpu_loads_bf16_and_logs_why(bf16_valued, monkeypatch, caplog):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AMX)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    with caplog.at_level(logging.INFO, logger="engine.device.cpu_dtype"):
        model = open_checkpoint(CheckpointConfig(bf16_valued, device="cpu")).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert (
        "dtype bfloat16 (--dtype auto): this CPU has AMX-bf16 and every fp32 weight is exactly "
        "a bf16 value" in caplog.messages
    )
    # --dtype forces, --exact keeps the checkpoint's dtype: neither is decided here
    parser, _ = build_parser()
    for flags in (["--dtype", "float32"], ["--exact"]):
        args = parser.parse_args(["serve", "--model", str(bf16_valued), "--device", "cpu", *flags])
        config = build_config(args, args.model, CHECKPOINT_FLAGS).checkpoint
        model = open_checkpoint(config).model
        assert {p.dtype for p in model.parameters()} == {torch.float32}, flags


def test_auto_without_amx_widens_a_bf16_checkpoint_unless_forced(bf16_valued, monkeypatch):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AVX512_BF16)
    weights = load_file(bf16_valued / "model.safetensors")
    save_file(
        {k: t.to(torch.bfloat16) for k, t in weights.items()}, bf16_valued / "model.safetensors"
    )
    config = json.loads((bf16_valued / "config.json").read_text())
    (bf16_valued / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    assert auto_dtype(bf16_valued, "auto", "cpu", False, "auto") == "float32"
    model = open_checkpoint(CheckpointConfig(bf16_valued, dtype="bfloat16", device="cpu")).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_a_gpu_fp8_and_forced_dtypes_are_not_decided_here(tmp_path: Path):
    missing = tmp_path / "nothing-read"  # nothing is opened to decide these
    assert auto_dtype(missing, "auto", "cuda", False, "auto") == "auto"
    assert auto_dtype(missing, "auto", "cpu", True, "auto") == "auto"
    assert auto_dtype(missing, "auto", "cpu", False, "fp8") == "auto"
    assert auto_dtype(missing, "bfloat16", "cpu", False, "auto") == "bfloat16"


def test_an_unreadable_checkpoint_is_left_to_the_loader(bf16_valued, monkeypatch, caplog):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AMX)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    weights = bf16_valued / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # truncated: the loader's error names it
    with caplog.at_level(logging.INFO, logger="engine.device.cpu_dtype"):
        assert auto_dtype(bf16_valued, "auto", "cpu", False, "auto") == "auto"
    assert not caplog.records
