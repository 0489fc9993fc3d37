"""The router, experts and sampler as custom ops (`kernels.ops_step`): the fast twins' values
on the CPU, registrations `torch.library.opcheck` accepts, and outputs on the meta device."""

from __future__ import annotations

import torch

from kernels import ops_step, reference, resolve_kernels

GEN = torch.Generator().manual_seed(0)
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _moe_inputs() -> tuple[torch.Tensor, ...]:
    hidden = torch.randn(7, 16, generator=GEN)
    proj, scale, per_expert = torch.randn(4, 16, generator=GEN), torch.ones(16), torch.rand(4)
    gate_up, down = torch.randn(4, 16, 16, generator=GEN), torch.randn(4, 16, 8, generator=GEN)
    return hidden, scale, proj, per_expert, gate_up, down


def test_router_and_experts_ops_give_the_fast_twins_values() -> None:
    hidden, scale, proj, per_expert, gate_up, down = _moe_inputs()
    weights, ids = ops_step.route_experts(hidden, scale, proj, per_expert, 2, 1e-6)
    want_w, want_ids = reference.route_experts(hidden, scale, proj, per_expert, 2, 1e-6)
    assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
    got = ops_step.fused_moe(hidden, gate_up, down, weights, ids)
    assert torch.equal(got, reference.fused_moe_scattered(hidden, gate_up, down, weights, ids))
    torch.library.opcheck(
        torch.ops.canvas.route_experts,
        (hidden, scale, proj, per_expert, 2, 1e-6),
        test_utils=CHECKS,
    )
    moe = (hidden, gate_up, down, weights, ids)
    torch.library.opcheck(torch.ops.canvas.fused_moe, moe, test_utils=CHECKS)


def test_sampler_ops_give_the_twins_values() -> None:
    logits = torch.randn(6, 40, generator=GEN)
    temperature, uniform = torch.full((6,), 0.8), torch.rand(6, generator=GEN)
    weight = torch.randn(40, 8, generator=GEN)
    result, soft = ops_step.sample_and_embed(logits, temperature, uniform, weight, 2.0)
    want, want_soft = reference.sample_and_embed(logits, temperature, uniform, weight, 2.0)
    assert torch.equal(soft, want_soft)
    for name in ("sample", "argmax", "entropy", "lse"):
        assert torch.equal(getattr(result, name), getattr(want, name)), name
    alone = ops_step.fused_sample(logits, temperature, uniform)
    assert torch.equal(alone.sample, want.sample)
    embedded = ops_step.soft_embedding(logits, temperature, want.lse, weight, 2.0)
    assert torch.equal(
        embedded, reference.soft_embedding(logits, temperature, want.lse, weight, 2.0)
    )
    entropy, bound = want.entropy.view(2, 3), torch.tensor([0.5, 3.0])
    assert torch.equal(
        ops_step.entropy_accept(entropy, bound), reference.entropy_accept(entropy, bound)
    )
    args = (logits, temperature, uniform, weight, 2.0)
    torch.library.opcheck(torch.ops.canvas.sample_and_embed, args, test_utils=CHECKS)


def test_every_kernel_of_the_custom_op_set_is_an_op() -> None:
    ks = resolve_kernels("cpu", "twins").with_custom_ops()
    for name in ("route_experts", "fused_moe", "fused_sample", "entropy_accept", "soft_embedding"):
        assert getattr(ks, name) is getattr(ops_step, name), name
    meta = torch.device("meta")
    logits = torch.empty(5, 11, device=meta)
    result, soft = ks.sample_and_embed(
        logits, torch.empty(5, device=meta), torch.empty(5, device=meta),
        torch.empty(11, 3, dtype=torch.bfloat16, device=meta), 1.0,
    )  # fmt: skip
    assert result.sample.dtype == torch.int64 and result.lse.shape == (5,)
    assert soft.shape == (5, 3) and soft.dtype == torch.bfloat16
