"""RoPE as the layers apply it: half-width passes into one output, the reference's
x * cos + rotate_half(x) * sin bit for bit, whatever the batch's size."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import apply_rope, apply_rope_fused
from kernels import reference


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 16), (37, 4, 64), (512, 2, 128)])
def test_fused_rope_is_the_reference_formula_bit_for_bit(
    tokens: int, heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    freqs = torch.randn(1, tokens, head_dim // 2, generator=gen) * 50
    emb = torch.cat([freqs, freqs], -1)
    x = torch.randn(1, tokens, heads, head_dim, generator=gen)
    with torch.no_grad():
        got = apply_rope_fused(x, emb.cos(), emb.sin())
    assert torch.equal(got, apply_rope(x, emb.cos(), emb.sin()))
    # Each token's values do not depend on the tokens beside it (no fused multiply-add that a
    # vectorised loop applies and its tail does not).
    first = apply_rope_fused(x[:, :1], emb[:, :1].cos(), emb[:, :1].sin())
    assert torch.equal(first, got[:, :1])
    # Training (autograd on): the same values, and gradients flow.
    with torch.enable_grad():
        leaf = x.clone().requires_grad_(True)
        trained = apply_rope_fused(leaf, emb.cos(), emb.sin())
        trained.sum().backward()
    assert torch.equal(trained.detach(), got) and leaf.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_norm_rope_twins_are_the_layers_former_sequence_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    """The norms through the bound set's `rms_norm` on [1, N, H, D], then `apply_rope_fused`:
    exact numerics (the reference norm) and fast numerics (the fused norm) alike."""
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 37, h, 64, generator=gen).to(dtype) for h in (3, 1))
    weights = [(torch.rand(64, generator=gen) + 0.5).to(dtype) for _ in range(2)]
    freqs = torch.randn(1, 37, 32, generator=gen) * 50
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    for norm, fused in (
        (reference.rms_norm, reference.qkv_norm_rope_exact),
        (reference.rms_norm_fused, reference.qkv_norm_rope),
    ):
        with torch.no_grad():
            want = (
                apply_rope_fused(norm(q, weights[0], 1e-6), cos, sin)[0],
                apply_rope_fused(norm(k, weights[1], 1e-6), cos, sin)[0],
                norm(k, None, 1e-6)[0],
            )
            got = fused(q[0], k[0], k[0], *weights, cos[0], sin[0], 1e-6)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
