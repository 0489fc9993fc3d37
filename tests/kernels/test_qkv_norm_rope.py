"""Attention's q/k/v norms and RoPE in one Triton kernel (`triton_norm.qkv_norm_rope`) against
its twin, over fp32 and bf16, both layer kinds of DiffusionGemma (default RoPE on sliding
layers, proportional RoPE with a partial rotary factor of 0.25 on full layers, where V is the
raw k_proj output), odd head counts and strided heads; and the op `canvas::qkv_norm_rope`."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import RopeSpec
from engine.model.layers import rope_inv_freq
from kernels import ops_step, reference, resolve_kernels

pytest.importorskip("triton")
from kernels import triton_norm  # noqa: E402  (needs triton)

GEN = torch.Generator().manual_seed(0)
SLIDING = RopeSpec("default", 10_000.0)
FULL = RopeSpec("proportional", 1_000_000.0, partial_rotary_factor=0.25)


def _tables(rope: RopeSpec, num_tokens: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """cos, sin [N, D] as `DiffusionLM._rope` builds them, at scattered positions."""
    positions = torch.randint(0, 5000, (num_tokens,), generator=GEN)
    freqs = positions[:, None].float() * rope_inv_freq(rope, dim).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return [emb.cos().to(dtype), emb.sin().to(dtype)]


def _heads(num_tokens: int, heads: int, dim: int, dtype: torch.dtype, pad: int = 0) -> torch.Tensor:
    """[N, heads, D] values (heads `pad` elements apart when padded: a strided view)."""
    wide = torch.randn(num_tokens, heads, dim + pad, generator=GEN) * 3
    return wide[..., :dim].to(dtype)


@pytest.mark.parametrize(
    "rope,num_tokens,q_heads,kv_heads,dim,pad,v_is_k",
    [
        (SLIDING, 1, 1, 1, 32, 0, False),  # one token
        (SLIDING, 37, 3, 1, 64, 8, False),  # odd heads, strided heads
        (FULL, 19, 5, 3, 128, 0, True),  # a full layer: V is the raw k_proj output
        (FULL, 6, 2, 1, 40, 0, True),  # a half width that is not a power of two
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_norm_rope_matches_twin(
    rope: RopeSpec,
    num_tokens: int,
    q_heads: int,
    kv_heads: int,
    dim: int,
    pad: int,
    v_is_k: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    q, k = _heads(num_tokens, q_heads, dim, dtype, pad), _heads(num_tokens, kv_heads, dim, dtype)
    v = k if v_is_k else _heads(num_tokens, kv_heads, dim, dtype, pad)
    weights = [(torch.rand(dim, generator=GEN) + 0.5).to(dtype) for _ in range(2)]
    args = [t.to(device) for t in (q, k, v, *weights, *_tables(rope, num_tokens, dim, dtype))]
    got = triton_norm.qkv_norm_rope(*args, 1e-6)
    want = reference.qkv_norm_rope(*[t.cpu() for t in args], 1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == dtype and g.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)
        else:  # the norm's fp32 result may round to the neighbouring bf16
            torch.testing.assert_close(g.cpu(), w, rtol=2e-2, atol=2e-2)
    if rope is FULL:  # 3/4 of each half is not rotated: the normed values pass through
        rotated = dim // 2 // 4
        normed = reference.rms_norm_fused(q, weights[0], 1e-6)
        keep = torch.cat([torch.arange(rotated, dim // 2), torch.arange(dim // 2 + rotated, dim)])
        torch.testing.assert_close(got[0].cpu()[..., keep], normed[..., keep])


def test_qkv_norm_rope_op_gives_the_fast_twins_values_and_shapes_on_meta() -> None:
    q, k, v = (_heads(5, h, 16, torch.float32) for h in (3, 1, 1))
    weights = [torch.rand(16, generator=GEN) for _ in range(2)]
    args = (q, k, v, *weights, *_tables(SLIDING, 5, 16, torch.float32), 1e-6)
    got = ops_step.qkv_norm_rope(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, reference.qkv_norm_rope(*args), strict=True))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.canvas.qkv_norm_rope, args, test_utils=checks)
    assert resolve_kernels("cpu", "twins").with_custom_ops().qkv_norm_rope is ops_step.qkv_norm_rope
    meta = [torch.empty(t.shape, dtype=torch.bfloat16, device="meta") for t in args[:-1]]
    outs = ops_step.qkv_norm_rope(*meta, 1e-6)
    assert [o.shape for o in outs] == [q.shape, k.shape, v.shape]


def test_only_the_fast_triton_set_binds_the_fused_kernel() -> None:
    assert resolve_kernels("cpu", "triton").qkv_norm_rope is triton_norm.qkv_norm_rope
    assert resolve_kernels("cpu", "twins").qkv_norm_rope is reference.qkv_norm_rope
    for backend in ("triton", "twins"):
        exact = resolve_kernels("cpu", backend, exact=True)
        assert exact.qkv_norm_rope is reference.qkv_norm_rope_exact
