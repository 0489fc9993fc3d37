"""RoPE as the layers apply it: half-width passes into one output, the reference's
x * cos + rotate_half(x) * sin bit for bit, whatever the batch's size."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import apply_rope, apply_rope_fused


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
