"""The weight-only int8 microbenchmark (`loadtest.cpu.int8_bench`): its shapes, its quantizer,
and that every method it times computes the same projection."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.checkpoints.tiny import (
    PRESETS,
    REAL_26B_A4B_CANVAS_LENGTH,
    REAL_26B_A4B_TEXT_CONFIG,
    preset_text_config,
)
from kernels.native.packing import PackedWeights
from loadtest.cpu import int8_bench


def test_a_layers_shapes_at_one_canvas():
    small = int8_bench.shapes_of(
        "bench-small", preset_text_config("bench-small"), PRESETS["bench-small"].canvas_length
    )
    assert small.rows == 64 and small.layers == 6
    assert small.dense == ((512, 512), (256, 512), (256, 512), (512, 512))[:4] + (
        (384, 512),
        (384, 512),
        (512, 384),
    )
    assert (small.expert_rows, small.touched) == (8, 16)  # 64 x top-2 over 16 experts
    real = int8_bench.shapes_of("real", REAL_26B_A4B_TEXT_CONFIG, REAL_26B_A4B_CANVAS_LENGTH)
    assert real.dense[0] == (4096, 2816) and real.dense[-1] == (2816, 2112)
    assert (real.expert_rows, real.touched, real.inter) == (16, 128, 704)
    one = int8_bench.shapes_of("real", REAL_26B_A4B_TEXT_CONFIG, 1)
    assert (one.expert_rows, one.touched) == (1, 8)


def test_the_quantizer_is_symmetric_per_output_channel():
    w = torch.randn(40, 24) * torch.linspace(0.01, 3.0, 40)[:, None]
    q, scale = int8_bench.quantize(w, torch.float32)
    assert q.dtype is torch.int8 and scale.shape == (40,)
    assert q.abs().amax(1).eq(127).all()  # each row's largest weight is its full range
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 8])
def test_every_method_computes_x_times_the_weight_transposed(rows):
    torch.manual_seed(0)
    w, x = torch.randn(64, 96) / 10, torch.randn(rows, 96)
    want = x @ w.T
    with torch.no_grad():
        for label, (dtype, store, lin) in int8_bench.methods(PackedWeights(), rows).items():
            got = lin(x.to(dtype), store(w)).float()
            # bf16 operands and int8 weights: within their rounding of a sum of 96 products
            tol = 1e-4 if label == "fp32" else 0.05
            assert got.shape == want.shape, label
            assert (got - want).abs().max() <= tol * want.abs().max(), label


def test_copies_span_the_checkpoints_layers_or_the_footprint():
    assert int8_bench.copies_for(1000, 6, 1 << 30) == 6
    assert int8_bench.copies_for(1000, 0, 10_500) == 11
    assert int8_bench.copies_for(1 << 30, 0, 10) == 2  # never one copy: the cache would hold it


def test_a_layers_times_cover_every_method_and_canvas_natives_experts(capsys):
    shapes = int8_bench.Shapes("small", 8, 2, ((64, 32), (32, 64)), 4, 2, 32, 32)
    args = argparse.Namespace(rounds=1, warmup=0, footprint_mb=1)
    dense, experts = int8_bench.layer_times(shapes, args, 2, native=True)
    labels = {"fp32", "bf16", "int8", "int8>bf16", "int8 f32"}
    labels |= {"bf16 reordered"} if torch.backends.mkldnn.is_available() else set()
    assert set(dense) == labels
    assert set(experts) == labels | {"fp32 native", "bf16 native"}
    assert all(0 < f <= m for m, f in [*dense.values(), *experts.values()])
    out = capsys.readouterr().out
    assert "small: 8 rows, 4 experts x 4 rows" in out and "2 layer copies" in out


def test_the_forward_estimate_swaps_the_layers_projections(tiny_checkpoint, capsys):
    args = argparse.Namespace(rounds=1, warmup=0)
    labels = ("fp32", "bf16", "int8", "int8>bf16", "fp32 native", "bf16 native")
    # projections far cheaper than a forward: each estimate is a speed-up
    times = {label: (1e-6, 1e-6) for label in labels} | {"int8": (1e-7, 1e-7)}
    int8_bench.forward_estimate(tiny_checkpoint("c16"), args, times, times)
    out = capsys.readouterr().out
    assert "forward at one canvas" in out
    assert "medians:" in out and "fastest:" in out and "with int8 dense est. 1.00x" in out
