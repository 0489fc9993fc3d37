"""bf16 dense projections on oneDNN with the weight reordered once per binding
(`kernels.native.onednn`, dispatched by `kernels.native.bf16.dense`): the twin's values within a
bf16 ulp at odd sizes, a row within a bf16 ulp of itself in another batch (oneDNN's sums, as the
twin's, may round a row's value one ulp apart with its batch), one reorder per weight until it
changes in place, the twin where the binding or torch cannot, fp32 operands untouched."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import reference
from kernels.native import bf16, onednn
from kernels.native import moe as native_moe
from kernels.native.packing import PackedWeights
from tests.kernels.native_cases import NATIVE

pytestmark = NATIVE
# One bf16 ulp (8 significant bits) of the twin's value; atol for sums that cancel to near 0.
ULP_RTOL, ULP_ATOL = 2**-7, 1e-3
HAS_ONEDNN = pytest.mark.skipif(
    onednn.unavailable() is not None, reason=f"no prepacked oneDNN: {onednn.unavailable()}"
)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _count_reorders(monkeypatch) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    real = onednn.reorder
    monkeypatch.setattr(onednn, "reorder", lambda w: seen.append(w) or real(w))
    return seen


@HAS_ONEDNN
@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize("k,n", [(37, 21), (130, 100), (511, 66)])
@torch.no_grad()
def test_the_reordered_weight_gives_the_twins_values_whatever_the_batch(monkeypatch, rows, k, n):
    seen = _count_reorders(monkeypatch)
    x, weight = _randn(rows, k, seed=rows), _randn(n, k, seed=k, scale=k**-0.5)
    packs = PackedWeights(onednn=True)
    got = bf16.dense(x, weight, [rows], packs)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n) and len(seen) == 1
    twin = reference.linear(x, weight, [rows])
    torch.testing.assert_close(got, twin, rtol=ULP_RTOL, atol=ULP_ATOL)
    today = bf16.linear(x, weight, [rows], None)  # the dispatch without a binding's oneDNN
    torch.testing.assert_close(got, today, rtol=ULP_RTOL, atol=ULP_ATOL)
    more = torch.cat([_randn(5, k, seed=1), x, _randn(9, k, seed=2)])
    among = bf16.dense(more, weight, [rows + 14], packs)[5 : 5 + rows]
    torch.testing.assert_close(among, got, rtol=ULP_RTOL, atol=ULP_ATOL)
    batched = bf16.dense(torch.stack([x, x]), weight, [rows, rows], packs)
    assert batched.shape == (2, rows, n)
    torch.testing.assert_close(batched[1], got, rtol=ULP_RTOL, atol=ULP_ATOL)
    assert len(seen) == 1  # reordered once for all three calls


@HAS_ONEDNN
@torch.no_grad()
def test_a_binding_runs_its_bf16_projections_on_weights_reordered_once(monkeypatch):
    """Through `kernels.native.moe` as a bound model calls it: q/k/v (`linear_many`: one
    product, the three weights reordered together), GeGLU (`gated_linear`: gate and up
    together, the GeGLU over the product's halves) and a projection the tiles would not take
    (`linear`, 20 outputs), each reordered at its first use only."""
    bound = kernels.resolve_kernels("cpu").for_model()
    assert bound.linear.keywords["packs"].onednn
    seen = _count_reorders(monkeypatch)
    monkeypatch.setattr(bf16, "onednn_amx", lambda: True)  # every dense one to oneDNN
    x = _randn(17, 48, seed=3)
    q, k, v = (_randn(n, 48, seed=n, scale=0.2) for n in (64, 32, 96))
    gate_up = _randn(48, 48, seed=5, scale=0.2), _randn(48, 48, seed=6, scale=0.2)
    odd = _randn(20, 48, seed=4, scale=0.2)
    for _ in range(2):
        outs = bound.linear_many(x, [q, k, v], [17])
        geglu = bound.gated_linear(x, *gate_up, "gelu_pytorch_tanh", [17])
        single = bound.linear(x, odd, [17])
    assert [w.shape[0] for w in seen] == [64 + 32 + 96, 2 * 48, 20]
    assert [o.shape for o in outs] == [(17, 64), (17, 32), (17, 96)] and geglu.shape == (17, 48)
    for got, w in zip([*outs, single], [q, k, v, odd], strict=True):
        torch.testing.assert_close(got, F.linear(x, w), rtol=ULP_RTOL, atol=ULP_ATOL)
    want = bf16.gated_act(F.linear(x, gate_up[0]), F.linear(x, gate_up[1]), "gelu_pytorch_tanh")
    torch.testing.assert_close(geglu, want, rtol=ULP_RTOL, atol=ULP_ATOL)


@HAS_ONEDNN
@torch.no_grad()
def test_a_weight_changed_in_place_is_reordered_again(monkeypatch):
    seen = _count_reorders(monkeypatch)
    x, weight = _randn(3, 33, seed=1), _randn(50, 33, seed=2)
    packs = PackedWeights(onednn=True)
    before = native_moe.linear(x, weight, [3], packs)
    assert torch.equal(native_moe.linear(x, weight, [3], packs), before) and len(seen) == 1
    weight.mul_(-2)  # a loaded checkpoint, a training step
    after = native_moe.linear(x, weight, [3], packs)
    assert len(seen) == 2
    torch.testing.assert_close(after, F.linear(x, weight), rtol=ULP_RTOL, atol=ULP_ATOL)
    assert not torch.allclose(after, before)


@torch.no_grad()
def test_without_the_ops_a_binding_keeps_the_twin(monkeypatch, caplog):
    """torch without oneDNN, without the two ops or refusing a bf16 weight: the binding
    decides for the twin once (at debug) and never reorders."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert onednn.unavailable() == "torch has no oneDNN"
    with caplog.at_level(logging.DEBUG, logger=onednn.__name__):
        bound = kernels.resolve_kernels("cpu").for_model()
    assert not bound.linear.keywords["packs"].onednn
    assert "the twin" in caplog.text and "torch has no oneDNN" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(onednn, "OPS", (onednn.OPS[0], "_no_such_linear"))
    assert "lacks _no_such_linear" in str(onednn.unavailable())
    monkeypatch.undo()

    def refuse(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(onednn, "reorder", refuse)
    assert "refused" in str(onednn.unavailable()) and not onednn.decide()
    monkeypatch.setattr(onednn, "linear", pytest.fail)
    x, weight = _randn(4, 40, seed=1), _randn(24, 40, seed=2)
    for packs in (PackedWeights(onednn=False), None):
        got = bf16.dense(x, weight, [4], packs)
        assert torch.equal(got, reference.linear(x, weight, [4]))
    packs = PackedWeights(onednn=True)  # an empty weight, which oneDNN does not take: the twin
    assert bf16.dense(x, weight[:0], [4], packs).shape == (4, 0)
    assert not packs.copies


@torch.no_grad()
def test_fp32_operands_never_reach_onednn(monkeypatch):
    """fp32 projections (and so exact numerics, which binds no native kernel) keep their path
    with a binding that chose oneDNN."""
    monkeypatch.setattr(onednn, "reorder", pytest.fail)
    monkeypatch.setattr(onednn, "linear", pytest.fail)
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(200, 64, generator=g), torch.randn(64, 64, generator=g)
    got = native_moe.linear(x, weight, [200], PackedWeights(onednn=True))
    assert torch.equal(got, native_moe.linear(x, weight, [200], PackedWeights()))
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    exact = kernels.resolve_kernels("cpu", "twins", exact=True).for_model()
    assert getattr(exact.linear, "func", exact.linear) is not native_moe.linear
