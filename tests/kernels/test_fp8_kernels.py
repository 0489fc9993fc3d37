"""The FP8 weight kernels of every backend (`fp8_linear`, `fp8_moe`): the twins dequantize
(`kernels.reference_fp8`) and run the unquantized kernel, so they give that kernel's values on
the dequantized weights exactly; Triton's expert GEMM reads the FP8 weights and dequantizes in
registers (parity with the twin at the activations' tolerances); the custom-op set runs them on
the meta device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference, resolve_kernels, triton_available

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


def moe_case(
    num_tokens: int, top_k: int, dtype: torch.dtype, device: torch.device, num_experts: int = 6
) -> tuple[torch.Tensor, ...]:
    """hidden [N, 32] (not contiguous), FP8 gate_up [E, 48, 32] and down [E, 32, 24] with
    their scales, routing weights and ids [N, top_k] (distinct experts per token)."""
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    hidden_size, inter = 32, 24
    gate_up, gate_up_scale = quantized(num_experts, 2 * inter, hidden_size, gen=gen)
    down, down_scale = quantized(num_experts, hidden_size, inter, gen=gen)
    hidden = torch.randn(num_tokens, hidden_size + 4, generator=gen)[:, 2:-2].to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    case = (hidden, gate_up, gate_up_scale, down, down_scale, weights, ids)
    return tuple(t.to(device) for t in case)


@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 1), (9, 3)])
def test_the_twins_fp8_moe_is_their_experts_on_dequantized_weights(
    num_tokens: int, top_k: int
) -> None:
    hidden, gate_up, gate_up_scale, down, down_scale, weights, ids = moe_case(
        num_tokens, top_k, torch.float32, torch.device("cpu")
    )
    ks = resolve_kernels("cpu", "twins")
    got = ks.fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids,
                     segments=[num_tokens])  # fmt: skip
    dense = (gate_up.float() * gate_up_scale, down.float() * down_scale)
    assert torch.equal(got, ks.fused_moe(hidden, *dense, weights, ids, segments=[num_tokens]))
    twin = reference.fused_moe(hidden, *dense, weights, ids)
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "half"),
    [(1, 1, False), (9, 3, False), (1, 2, True), (13, 2, True), (37, 2, True)],
)
def test_triton_fp8_moe_matches_the_twin(
    num_tokens: int, top_k: int, half: bool, device: torch.device
) -> None:
    """Odd token counts, several experts, top-k 2 in half precision (bf16 on the GPU; fp16 under
    the interpreter, whose bf16 dot products are not bf16's): the FP8 expert GEMM (weights cast
    in registers, scales in the epilogue) against the twin's dequantize-then-experts."""
    dtype = (torch.float16 if device.type == "cpu" else torch.bfloat16) if half else torch.float32
    case = moe_case(num_tokens, top_k, dtype, device)
    ks = resolve_kernels(device.type, "triton")
    assert ks.fp8_moe.__module__ == "kernels.triton_moe"  # not the dequantizing twin
    got = ks.fp8_moe(*case, segments=[num_tokens])
    want = reference.fp8_moe(*case)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_fp8_moe_applies_each_output_channels_scale(device: torch.device) -> None:
    """One channel's scale changed changes that channel of every expert's output alone: the
    epilogue indexes the scales by output column (gate's and up's halves apart)."""
    hidden, gate_up, gate_up_scale, down, down_scale, weights, ids = moe_case(
        5, 2, torch.float32, device, num_experts=3
    )
    ks = resolve_kernels(device.type, "triton")
    base = ks.fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids)
    down_scale = down_scale.clone()
    down_scale[:, 7] *= 2
    doubled = ks.fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids)
    torch.testing.assert_close(doubled[:, 7], 2 * base[:, 7])
    others = [c for c in range(base.shape[1]) if c != 7]
    assert torch.equal(doubled[:, others], base[:, others])
    up_scale = gate_up_scale.clone()
    up_scale[:, 24:] = 0  # the up half: every GEGLU product, hence every output, is zero
    assert not ks.fp8_moe(hidden, gate_up, up_scale, down, down_scale, weights, ids).any()


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


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize(("num_rows", "num_cols"), [(1, 16), (7, 48), (3, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_quantize_fp8_rows_matches_the_twin(
    num_rows: int, num_cols: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Per-token scales and E4M3 values (ties to even, subnormals, an all-zero row, a strided
    input) exactly as the twin computes them."""
    from kernels import triton_fp8

    gen = torch.Generator().manual_seed(num_cols)
    spread = torch.logspace(-5, 2, num_cols)  # values down into E4M3's subnormals
    x = (torch.randn(num_rows, num_cols + 3, generator=gen)[:, 3:] * spread).to(dtype)
    x[0, : num_cols // 2] = 0
    if num_rows > 1:
        x[1] = 0
    x = x.to(device)
    q, scale = triton_fp8.quantize_fp8_rows(x)
    want_q, want_scale = reference.quantize_fp8_rows(x)
    assert q.dtype == FP8 and scale.shape == (num_rows, 1)
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.float(), want_q.float())


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_fp8_linear_is_the_product_of_per_token_fp8_activations(
    device: torch.device,
) -> None:
    """`_scaled_mm` gets the activations' per-token scales as rows and the weight's per-channel
    scales as columns: its output is the fp32 product of both dequantized operands, in bf16."""
    from kernels import triton_fp8

    gen = torch.Generator().manual_seed(3)
    weight, scale = quantized(32, 48, gen=gen)
    x = torch.randn(2, 5, 48, generator=gen).bfloat16()
    weight, scale, x = weight.to(device), scale.to(device), x.to(device)
    got = triton_fp8.fp8_linear(x, weight, scale, [10])
    q, q_scale = reference.quantize_fp8_rows(x.reshape(10, 48))
    want = F.linear(q.float() * q_scale, weight.float() * scale).bfloat16().reshape(2, 5, 32)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 5, 32)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # against the unquantized activations: the FP8 rounding of x, nothing more
    dense = reference.fp8_linear(x, weight, scale, [10]).float()
    assert (got.float() - dense).abs().max() <= 0.1 * dense.abs().max()
    # operands outside `_scaled_mm`'s row-wise contract take the twin
    assert triton_fp8.fp8_linear(x[:0], weight, scale, []).shape == (0, 5, 32)
    odd = x[..., :40].float()
    assert torch.equal(
        triton_fp8.fp8_linear(odd, weight[:, :40], scale, [10]),
        reference.fp8_linear(odd, weight[:, :40], scale, [10]),
    )


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.parametrize(
    ("capability", "version", "scaled", "e4m3"),
    [((9, 0), "2.13.0", True, True), ((8, 9), "2.13.0", False, True),
     ((8, 0), "2.13.0", False, False), ((9, 0), "2.4.1", False, True)],
)  # fmt: skip
def test_triton_binds_scaled_mm_on_sm90_and_e4m3_experts_from_sm89(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    version: str,
    scaled: bool,
    e4m3: bool,
) -> None:
    """Projections: `_scaled_mm` on sm_90 with a torch that has row-wise scales, else the twin.
    Experts: Triton's FP8 kernel where Triton has E4M3, else dequantized for `fused_moe`."""
    from kernels import triton_fp8, triton_moe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch, "__version__", version)
    ks = resolve_kernels("cuda", "triton")
    assert ks.fp8_linear is (triton_fp8.fp8_linear if scaled else reference.fp8_linear)
    assert (ks.fp8_moe is triton_moe.fp8_moe) == e4m3
    if not e4m3:  # the dequantizing path over Triton's experts: their values exactly
        case = moe_case(5, 2, torch.float32, torch.device("cpu"))
        hidden, gate_up, gate_up_scale, down, down_scale, weights, ids = case
        dense = (gate_up.float() * gate_up_scale, down.float() * down_scale)
        want = triton_moe.fused_moe(hidden, *dense, weights, ids)
        assert torch.equal(ks.fp8_moe(*case, segments=[5]), want)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_kernels("cuda", "triton").fp8_linear is reference.fp8_linear


def test_the_custom_op_set_computes_the_twins_values_on_the_cpu() -> None:
    gen = torch.Generator().manual_seed(5)
    ks = resolve_kernels("cpu", "twins").with_custom_ops()
    weight, scale = quantized(24, 32, gen=gen)
    x = torch.randn(3, 32, generator=gen)
    assert torch.equal(
        ks.fp8_linear(x, weight, scale, [3]), reference.fp8_linear(x, weight, scale, [])
    )
    case = moe_case(7, 2, torch.float32, torch.device("cpu"))
    assert torch.equal(ks.fp8_moe(*case, segments=[7]), reference.fp8_moe(*case))
