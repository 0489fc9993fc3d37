"""A layer's fused element-wise tails (`add_rms_norm`, `rms_norm_pair`, `close_layer`,
`gated_act`): the twins are the unfused layer's ops bit for bit in both numerics, the Triton
kernels (`kernels.triton_layer`) agree with the twins over fp32 and bf16, odd sizes and per-token
layer scalars, and the custom ops (`kernels.ops_layer`) give the fast twins' values on the CPU
and shapes on meta."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops_layer, reference, resolve_kernels

pytest.importorskip("triton")
from kernels import triton_layer  # noqa: E402  (needs triton)

GEN = torch.Generator().manual_seed(0)
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")
EPS = 1e-6


def _rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype)


def _weight(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.rand(dim, generator=GEN) + 0.5).to(dtype)


def _close_args(shape: tuple[int, ...], dtype: torch.dtype, per_token: bool) -> tuple:
    dim, tokens = shape[-1], shape[-2]
    scale = _weight(tokens if per_token else 1, dtype)
    scale = scale.view(1, tokens, 1) if per_token else scale
    moe = _rand(*shape, dtype=dtype, scale=0.05)  # the branches' very different magnitudes
    return (_rand(*shape, dtype=dtype), moe, _rand(*shape, dtype=dtype), _weight(dim, dtype),
            _weight(dim, dtype), _weight(dim, dtype), scale, EPS)  # fmt: skip


@pytest.mark.parametrize(
    "norm,exact", [(reference.rms_norm_fused, False), (reference.rms_norm, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twins_are_the_unfused_layer_ops_bit_for_bit(norm, exact: bool, dtype) -> None:  # noqa: ANN001
    x, residual, dim = _rand(1, 6, 40, dtype=dtype), _rand(1, 6, 40, dtype=dtype), 40
    wa, wb = _weight(dim, dtype), _weight(dim, dtype)
    suffix = "_exact" if exact else ""
    add = getattr(reference, "add_rms_norm" + suffix)
    pair = getattr(reference, "rms_norm_pair" + suffix)
    close = getattr(reference, "close_layer" + suffix)
    assert torch.equal(add(residual, x, wa, EPS), residual + norm(x, wa, EPS))
    got_a, got_b = pair(x, wa, wb, EPS)
    assert torch.equal(got_a, norm(x, wa, EPS)) and torch.equal(got_b, norm(x, wb, EPS))
    for per_token in (False, True):
        dense, moe, res, w1, w2, w, scale, _ = _close_args((1, 6, 40), dtype, per_token)
        want = (res + norm(norm(dense, w1, EPS) + norm(moe, w2, EPS), w, EPS)) * scale
        assert torch.equal(close(dense, moe, res, w1, w2, w, scale, EPS), want)
    gate, up = _rand(3, 50, dtype=dtype), _rand(3, 50, dtype=dtype)
    want_gelu = F.gelu(gate, approximate="tanh") * up
    assert torch.equal(reference.gated_act(gate, up, "gelu_pytorch_tanh"), want_gelu)
    assert torch.equal(reference.gated_act(gate, up, "silu"), F.silu(gate) * up)


def test_exact_twins_keep_autograd_working() -> None:
    """Training runs the exact twins with autograd: no in-place op on what backward needs."""
    x = _rand(1, 4, 16).requires_grad_()
    args = _close_args((1, 4, 16), torch.float32, per_token=True)
    out = reference.close_layer_exact(x, *args[1:])
    out = out + reference.add_rms_norm_exact(x, x, args[3], EPS)
    out = out + sum(reference.rms_norm_pair_exact(x, args[3], args[4], EPS))
    out = out + reference.gated_act(x, x, "gelu_pytorch_tanh")
    out.sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    else:  # each bf16 rounding may differ by an ulp; a sum that cancels keeps that ulp of its
        # terms (values up to ~10 here: an ulp is up to 0.06)
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=6e-2)


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 5, 2816), (7, 37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_tails_match_their_twins(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    dim = shape[-1]
    x, residual = _rand(*shape, dtype=dtype), _rand(*shape, dtype=dtype)
    wa, wb = _weight(dim, dtype), _weight(dim, dtype)
    on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    got = triton_layer.add_rms_norm(*on(residual, x, wa), EPS)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, reference.add_rms_norm_exact(residual, x, wa, EPS))
    got_a, got_b = triton_layer.rms_norm_pair(*on(x, wa, wb), EPS)
    _close(got_a, reference.rms_norm(x, wa, EPS))
    _close(got_b, reference.rms_norm(x, wb, EPS))
    for per_token in (False, True):
        *tensors, _ = _close_args(shape, dtype, per_token)
        if per_token and len(shape) == 2:
            tensors[-1] = tensors[-1].view(shape[0], 1)
        got = triton_layer.close_layer(*on(*tensors), EPS)
        _close(got, reference.close_layer_exact(*tensors, EPS))


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_matches_its_twin(activation: str, dtype, device: torch.device) -> None:  # noqa: ANN001
    gate, up = _rand(3, 1001, dtype=dtype), _rand(3, 1001, dtype=dtype)
    gate[0, :4] = torch.tensor([0.0, 1e-4, -30.0, 30.0])  # tails of tanh and exp
    got = triton_layer.gated_act(gate.to(device), up.to(device), activation)
    assert got.shape == gate.shape and got.dtype == dtype
    _close(got, reference.gated_act(gate, up, activation))


def test_close_layer_rejects_a_scale_that_fits_no_row_count(device: torch.device) -> None:
    *tensors, _ = _close_args((1, 6, 32), torch.float32, per_token=False)
    tensors[-1] = torch.ones(4)
    with pytest.raises(AssertionError, match="scale: 4 values for 6 rows"):
        triton_layer.close_layer(*[t.to(device) for t in tensors], EPS)


def test_ops_give_the_fast_twins_values_and_shapes_on_meta() -> None:
    x, residual, wa, wb = _rand(1, 5, 16), _rand(1, 5, 16), _weight(16), _weight(16)
    close = _close_args((1, 5, 16), torch.float32, per_token=True)
    cases = [
        (ops_layer.add_rms_norm, reference.add_rms_norm, (residual, x, wa, EPS)),
        (ops_layer.rms_norm_pair, reference.rms_norm_pair, (x, wa, wb, EPS)),
        (ops_layer.close_layer, reference.close_layer, close),
        (ops_layer.gated_act, reference.gated_act, (x, residual, "gelu_pytorch_tanh")),
    ]
    for op, twin, args in cases:
        got, want = op(*args), twin(*args)
        for g, w in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want)), strict=True):
            assert torch.equal(g, w), op.__name__
        torch.library.opcheck(getattr(torch.ops.canvas, op.__name__), args, test_utils=CHECKS)
    ks = resolve_kernels("cpu", "twins").with_custom_ops()
    assert ks.close_layer is ops_layer.close_layer and ks.gated_act is ops_layer.gated_act
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in close]
    assert ks.close_layer(*meta).shape == (1, 5, 16)
    pair = ks.rms_norm_pair(meta[0], meta[3], meta[4], EPS)
    assert [p.shape for p in pair] == [(1, 5, 16)] * 2


def test_kernel_sets_bind_the_tails_by_numerics() -> None:
    exact, fast = resolve_kernels("cpu", exact=True), resolve_kernels("cpu", "twins")
    assert exact.close_layer is reference.close_layer_exact
    assert exact.add_rms_norm is reference.add_rms_norm_exact
    assert (
        fast.close_layer is reference.close_layer and fast.rms_norm_pair is reference.rms_norm_pair
    )
