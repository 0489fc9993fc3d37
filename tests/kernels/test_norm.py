"""RMSNorm and the LM head's softcap: the Triton kernels (`kernels.triton_norm`) against their
twins, over fp32 and bf16, odd sizes, per-head shapes and strided inputs; and both as custom
ops (`kernels.ops_step`) with the fast twins' values on the CPU and outputs on meta."""

from __future__ import annotations

import pytest
import torch

from kernels import ops_step, reference, resolve_kernels

pytest.importorskip("triton")
from kernels import triton_norm  # noqa: E402  (needs triton)

GEN = torch.Generator().manual_seed(0)
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _wide(shape: tuple[int, ...], pad: int = 3) -> torch.Tensor:
    """Values [*shape] as the leading part of a wider tensor (rows through a stride)."""
    wide = torch.randn(*shape[:-1], shape[-1] + pad, generator=GEN) * 3
    return wide[..., : shape[-1]]


@pytest.mark.parametrize(
    "shape,weighted",
    [
        ((1, 1, 64), True),  # one token
        ((1, 5, 2816), True),  # the hidden states of 26B-A4B
        ((1, 7, 3, 256), True),  # per-head q/k norms [1, N, heads, D]
        ((1, 6, 2, 512), False),  # the unweighted v norm of the full layers
        ((4, 37), True),  # odd row length, strided rows
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_twin(
    shape: tuple[int, ...], weighted: bool, dtype: torch.dtype, device: torch.device
) -> None:
    x = _wide(shape).to(dtype)
    x = x if len(shape) == 2 else x.contiguous()
    weight = (torch.rand(shape[-1], generator=GEN) + 0.5).to(dtype) if weighted else None
    args = (x.to(device), None if weight is None else weight.to(device), 1e-6)
    got, want = triton_norm.rms_norm(*args), reference.rms_norm(*args)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # the fp32 results round to the same bf16 but within one ulp
        torch.testing.assert_close(got, want)


def test_rms_norm_reads_a_non_contiguous_head_view(device: torch.device) -> None:
    x = torch.randn(2, 5, 64, generator=GEN).to(device).transpose(0, 1)  # [5, 2, 64], strided
    weight = torch.rand(64, generator=GEN).to(device)
    got = triton_norm.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, reference.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_twin_in_one_pass(dtype: torch.dtype, device: torch.device) -> None:
    raw = (torch.randn(3, 1001, generator=GEN) * 40).to(dtype)  # beyond the cap, both signs
    raw[0, :4] = torch.tensor([0.0, 1e-4, -1e-4, 1e4])
    got = triton_norm.softcap(raw.to(device), 30.0)
    want = reference.softcap(raw.clone(), 30.0)
    assert got.dtype == torch.float32 and float(got.abs().max()) <= 30.0
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=4e-6)
    assert torch.equal(triton_norm.softcap(raw.to(device), None).cpu(), raw.float())


def test_softcap_twin_is_the_heads_conversion_then_in_place_cap() -> None:
    raw = (torch.randn(4, 50, generator=GEN) * 40).bfloat16()
    want = raw.float().div_(30.0).tanh_().mul_(30.0)
    assert torch.equal(reference.softcap(raw, 30.0), want)
    fp32 = raw.float()
    assert reference.softcap(fp32, 30.0) is fp32 and torch.equal(fp32, want)  # in place


def test_norm_and_softcap_ops_give_the_fast_twins_values_and_shapes_on_meta() -> None:
    x, weight = torch.randn(1, 5, 2, 16, generator=GEN), torch.rand(16, generator=GEN)
    assert torch.equal(
        ops_step.rms_norm(x, weight, 1e-6), reference.rms_norm_fused(x, weight, 1e-6)
    )
    assert torch.equal(ops_step.rms_norm(x, None, 1e-6), reference.rms_norm_fused(x, None, 1e-6))
    raw = torch.randn(3, 40, generator=GEN) * 40
    kept = raw.clone()
    assert torch.equal(ops_step.softcap(raw, 30.0), reference.softcap(kept.clone(), 30.0))
    assert torch.equal(raw, kept)  # the op never caps its input in place
    torch.library.opcheck(torch.ops.canvas.rms_norm, (x, weight, 1e-6), test_utils=CHECKS)
    torch.library.opcheck(torch.ops.canvas.rms_norm, (x, None, 1e-6), test_utils=CHECKS)
    torch.library.opcheck(torch.ops.canvas.softcap, (raw.bfloat16(), 30.0), test_utils=CHECKS)
    ks = resolve_kernels("cpu", "twins").with_custom_ops()
    assert ks.rms_norm is ops_step.rms_norm and ks.softcap is ops_step.softcap
    meta = torch.empty(1, 7, 2816, dtype=torch.bfloat16, device="meta")
    normed = ks.rms_norm(meta, torch.empty(2816, dtype=torch.bfloat16, device="meta"), 1e-6)
    assert normed.shape == meta.shape and normed.dtype == torch.bfloat16
    capped = ks.softcap(torch.empty(7, 11, dtype=torch.bfloat16, device="meta"), 30.0)
    assert capped.shape == (7, 11) and capped.dtype == torch.float32
