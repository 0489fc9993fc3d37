"""The FP8 weight kernels of every backend (`fp8_linear`, `fp8_moe`): for now each dequantizes
(`kernels.reference_fp8`) and runs the backend's unquantized kernel, so each must give that
kernel's values on the dequantized weights exactly; the custom-op set runs them on the meta
device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference, resolve_kernels, triton_available

BACKENDS = ["twins", pytest.param("triton", marks=pytest.mark.skipif(
    not triton_available(), reason="needs triton"))]  # fmt: skip
FP8 = torch.float8_e4m3fn


def quantized(*shape: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight [..., out, in] and its per-channel scale [..., out, 1]."""
    weight = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    scale = weight.abs().amax(-1, keepdim=True) / 448
    return (weight / scale).to(FP8), scale


def test_fp8_linear_is_the_linear_of_the_dequantized_weight() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, scale = quantized(24, 40, gen=gen)
    x = torch.randn(1, 7, 45, generator=gen)[..., 3:43]  # not contiguous
    ks = resolve_kernels("cpu", "twins")
    want = F.linear(x, weight.float() * scale)
    assert torch.equal(ks.fp8_linear(x, weight, scale, [7]), want)
    half = ks.fp8_linear(x.bfloat16(), weight, scale, [7])
    assert half.dtype == torch.bfloat16  # dequantized to the activations' dtype
    assert torch.equal(half, F.linear(x.bfloat16(), (weight.float() * scale).bfloat16()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (9, 3)])
def test_fp8_moe_is_the_backends_experts_on_dequantized_weights(
    backend: str, num_tokens: int, top_k: int, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    hidden_size, inter, num_experts = 32, 16, 6
    gate_up, gate_up_scale = quantized(num_experts, 2 * inter, hidden_size, gen=gen)
    down, down_scale = quantized(num_experts, hidden_size, inter, gen=gen)
    hidden = torch.randn(num_tokens, hidden_size + 4, generator=gen)[:, 2:-2]
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    on = [t.to(device) for t in (hidden, gate_up, gate_up_scale, down, down_scale, weights, ids)]
    hidden, gate_up, gate_up_scale, down, down_scale, weights, ids = on
    ks = resolve_kernels(device.type, backend)
    got = ks.fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids,
                     segments=[num_tokens])  # fmt: skip
    dense = (gate_up.float() * gate_up_scale, down.float() * down_scale)
    want = ks.fused_moe(hidden, *dense, weights, ids, segments=[num_tokens])
    assert torch.equal(got, want)
    twin = reference.fused_moe(hidden, *dense, weights, ids)
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)


def test_the_custom_op_set_runs_fp8_weights_on_the_meta_device() -> None:
    ks = resolve_kernels("cpu", "twins").with_custom_ops()
    with torch.device("meta"):
        x = torch.empty(5, 32)
        weight, scale = torch.empty(24, 32, dtype=FP8), torch.empty(24, 1)
        gate_up, down = torch.empty(4, 32, 32, dtype=FP8), torch.empty(4, 32, 16, dtype=FP8)
        weights, ids = torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int64)
        y = ks.fp8_linear(x, weight, scale, [5])
        out = ks.fp8_moe(x, gate_up, torch.empty(4, 32, 1), down, torch.empty(4, 32, 1),
                         weights, ids, segments=[5])  # fmt: skip
    assert y.shape == (5, 24) and out.shape == (5, 32) and out.device.type == "meta"
