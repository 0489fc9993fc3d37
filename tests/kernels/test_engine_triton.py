"""The engine on the Triton kernels (Triton's CPU interpreter, selected with
CANVAS_TRITON_ON_CPU=1): paged canvas attention over all rows at once, plus the Triton MoE and
sampler kernels, gives the tokens the twins' per-row path gives."""

from __future__ import annotations

import pytest

import kernels
from engine import LLM, SamplingParams

pytest.importorskip("triton")

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 31))]


def generate(path, monkeypatch: pytest.MonkeyPatch, triton: bool) -> list[list[int]]:
    monkeypatch.setenv("CANVAS_TRITON_ON_CPU", "1" if triton else "0")
    monkeypatch.delenv("CANVAS_FORCE_TWINS", raising=False)
    want = kernels.triton_ops() if triton else kernels.reference
    assert kernels.ops("cpu") is want
    llm = LLM.from_pretrained(path)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, seed=3))
    return [out.output_ids for out in outputs]


def test_engine_on_triton_kernels_matches_the_twins(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels/conftest.py sets it before import
    if not kernels.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1")
    path = tiny_checkpoint("c16")
    with_twins = generate(path, monkeypatch, triton=False)
    with_triton = generate(path, monkeypatch, triton=True)
    assert all(len(ids) > 0 for ids in with_twins)
    assert with_triton == with_twins
