"""Router, fused MoE and grouped GEMM: Triton kernels vs their twins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kernels import reference

pytest.importorskip("triton")
from kernels import triton_moe  # noqa: E402  (needs triton)

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass(frozen=True, slots=True)
class MoeShape:
    num_tokens: int
    hidden: int
    num_experts: int
    top_k: int
    inter: int


# Sizes are not powers of two but keep rows 16-byte aligned, which the twin's F.grouped_mm
# requires (the real model's 2816 and 704 are).
SHAPES = {
    "batch1-top1": MoeShape(1, 32, 4, 1, 16),
    "odd-tokens-non-power-of-two-dims": MoeShape(7, 40, 6, 2, 24),
    "more-tokens-than-a-block": MoeShape(37, 24, 5, 3, 12),
    "experts-not-power-of-two": MoeShape(9, 64, 12, 4, 16),
}


def make_layer(s: MoeShape, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(s.num_tokens * 7 + s.hidden)

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device)

    wide = rand(s.num_tokens, s.hidden + 5)  # rows of a wider tensor: not contiguous
    return {
        "hidden": wide[:, 2 : 2 + s.hidden],
        "scale": (torch.rand(s.hidden, generator=gen) + 0.5).to(dtype).to(device),
        "proj": rand(s.num_experts, s.hidden),
        "per_expert_scale": (torch.rand(s.num_experts, generator=gen) + 0.5).to(dtype).to(device),
        "gate_up": rand(s.num_experts, 2 * s.inter, s.hidden, std=s.hidden**-0.5),
        "down": rand(s.num_experts, s.hidden, s.inter, std=s.inter**-0.5),
    }


def route(impl: object, w: dict[str, torch.Tensor], s: MoeShape) -> tuple[torch.Tensor, ...]:
    args = (w["hidden"], w["scale"], w["proj"], w["per_expert_scale"], s.top_k, 1e-6)
    return impl.route_experts(*args)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_router_matches_twin(name: str, device: torch.device) -> None:
    s = SHAPES[name]
    w = make_layer(s, device, torch.float32)
    (got_w, got_ids), (want_w, want_ids) = route(triton_moe, w, s), route(reference, w, s)
    assert s.num_tokens == 1 or not w["hidden"].is_contiguous()
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_fused_moe_matches_twin(name: str, device: torch.device) -> None:
    s = SHAPES[name]
    w = make_layer(s, device, torch.float32)
    weights, ids = route(reference, w, s)
    args = (w["hidden"], w["gate_up"], w["down"], weights, ids)
    got, want = triton_moe.fused_moe(*args), reference.fused_moe(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_fp16_rounds_like_the_twin(device: torch.device) -> None:
    s = SHAPES["odd-tokens-non-power-of-two-dims"]
    w = make_layer(s, device, torch.float16)
    weights, ids = route(reference, w, s)
    args = (w["hidden"], w["gate_up"], w["down"], weights, ids)
    got, want = triton_moe.fused_moe(*args), reference.fused_moe(*args)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_fused_moe_writes_every_pair_row_without_a_zero_fill(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's buffers start as NaN: a pair row the kernels never wrote would show."""
    s = SHAPES["odd-tokens-non-power-of-two-dims"]
    w = make_layer(s, device, torch.float32)
    weights, ids = route(reference, w, s)
    args = (w["hidden"], w["gate_up"], w["down"], weights, ids)
    want = triton_moe.fused_moe(*args)
    empty = torch.empty

    def poisoned(*shape: Any, **kwargs: Any) -> torch.Tensor:
        out = empty(*shape, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    got = triton_moe.fused_moe(*args)
    assert not got.isnan().any() and torch.equal(got, want)


def test_fused_moe_is_batch_invariant(device: torch.device) -> None:
    """A token's output is bitwise the same alone and in a batch (no segments needed)."""
    s = SHAPES["more-tokens-than-a-block"]
    w = make_layer(s, device, torch.float32)
    weights, ids = route(triton_moe, w, s)
    moe = triton_moe.fused_moe
    together = moe(w["hidden"], w["gate_up"], w["down"], weights, ids)
    alone = moe(w["hidden"][5:6], w["gate_up"], w["down"], weights[5:6], ids[5:6])
    assert torch.equal(together[5:6], alone)


def test_align_pairs_groups_every_pair_once_by_expert() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [4, 2]])
    pairs, block_expert = triton_moe.align_pairs(ids, num_experts=5, block_m=2)
    flat = ids.reshape(-1)
    real = pairs[pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for b, expert in enumerate(block_expert.tolist()):
        block = pairs[2 * b : 2 * b + 2]
        block = block[block < flat.numel()]
        assert expert == 5 or (flat[block.long()] == expert).all()
    assert block_expert.tolist()[:4] == [0, 1, 2, 2] and 4 in block_expert.tolist()


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,block_m",
    [
        (0, 8, 128, 16),  # no pairs
        (1, 8, 128, 64),  # one token, the real router's experts and block
        (37, 3, 5, 2),  # few experts, tiny blocks: most rows padding-free
        (300, 4, 20, 16),  # ten chunks of pairs, counts carried across them
        (9, 1, 33, 4),  # grouped_mm's use: one slot, an expert count not a power of two
    ],
)
def test_align_pairs_matches_twin(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)
    if num_tokens > 100:  # a skewed routing: some experts full, some empty
        ids = ids % (num_experts // 2)
    got = triton_moe.align_pairs(ids.to(device), num_experts, block_m)
    want = reference.align_pairs(ids, num_experts, block_m)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int32 and torch.equal(g.cpu(), w)


@pytest.mark.parametrize(
    "offsets", [[3, 3, 8, 9, 9, 14], [0, 0, 0, 0, 0, 14], [14, 14, 14, 14, 14, 14]]
)
def test_grouped_mm_matches_twin(offsets: list[int], device: torch.device) -> None:
    gen = torch.Generator().manual_seed(len(offsets))
    x = torch.randn(14, 40, generator=gen).to(device)
    weight = torch.randn(6, 24, 40, generator=gen).to(device)
    index = torch.tensor(offsets, dtype=torch.int32, device=device)
    got, want = triton_moe.grouped_mm(x, weight, index), reference.grouped_mm(x, weight, index)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def router_probs(w: dict[str, torch.Tensor], s: MoeShape) -> torch.Tensor:
    """The twin's router probabilities [N, E] (up to one common factor per token): its top-E
    with unit expert scales, scattered back by expert id."""
    unit = torch.ones_like(w["per_expert_scale"])
    args = (w["hidden"], w["scale"], w["proj"], unit, s.num_experts, 1e-6)
    weights, ids = reference.route_experts(*args)
    return torch.zeros_like(weights).scatter_(1, ids, weights)


def assert_same_experts(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    probs: torch.Tensor,
) -> None:
    """Routings agree as sets: each token picks a top-k set of the twin's `probs` [N, E] with
    the same weight per expert, in any slot order. Half-precision scores tie exactly for about
    29% of tokens at the real shapes: CUDA's topk orders ties with an unstable sort, and a tie
    at the k-th score may pick either expert. Near-ties that two GEMM accumulation orders
    round differently may pick another set: at most 1% of tokens."""
    (got_w, got_ids), (want_w, want_ids) = got, want
    got_ids, got_order = got_ids.sort(dim=1)
    want_ids, want_order = want_ids.sort(dim=1)
    kth = probs.gather(1, want_ids).min(dim=1, keepdim=True).values  # [N, 1]
    distinct = (got_ids[:, 1:] > got_ids[:, :-1]).all(dim=1)
    top_k_set = distinct & (probs.gather(1, got_ids) >= kth).all(dim=1)
    assert top_k_set.float().mean() > 0.99, (
        f"{int((~top_k_set).sum())} of {top_k_set.numel()} tokens picked another expert set"
    )
    same = (got_ids == want_ids).all(dim=1)
    got_w, want_w = got_w.gather(1, got_order), want_w.gather(1, want_order)
    torch.testing.assert_close(got_w[same], want_w[same], rtol=2e-2, atol=2e-2)


def tied_layer(device: torch.device) -> tuple[MoeShape, dict[str, torch.Tensor]]:
    """A half-precision layer where experts 1 and 6 (and 2 and 9) have the same projection row
    and scale, so every token scores each pair exactly equal. fp16, not bf16: Triton's
    interpreter multiplies bf16 tl.dot operands wrongly (it is right on a GPU)."""
    s = MoeShape(64, 64, 12, 4, 16)
    w = make_layer(s, device, torch.float16)
    for a, b in ((1, 6), (2, 9)):
        w["proj"][b] = w["proj"][a]
        w["per_expert_scale"][b] = w["per_expert_scale"][a]
    return s, w


def test_router_half_picks_the_twins_expert_sets_despite_ties(device: torch.device) -> None:
    s, w = tied_layer(device)
    got, want = route(triton_moe, w, s), route(reference, w, s)
    assert not torch.equal(got[1], want[1])  # the twin breaks some ties the other way
    assert_same_experts(got, want, router_probs(w, s))


def test_expert_set_check_ignores_slot_order_of_ties() -> None:
    s, w = tied_layer(torch.device("cpu"))
    weights, ids = route(reference, w, s)
    tied = ids.masked_fill(ids == 6, 1).masked_fill(ids == 9, 2)  # experts 1, 2 where both
    tied = torch.where((tied == 1).sum(1, keepdim=True) > 1, ids, tied)
    tied = torch.where((tied == 2).sum(1, keepdim=True) > 1, ids, tied)
    assert not torch.equal(tied, ids)
    probs = router_probs(w, s)
    assert_same_experts((weights.flip(1), tied.flip(1)), (weights, ids), probs)


def test_expert_set_check_fails_on_a_wrong_router() -> None:
    s, w = tied_layer(torch.device("cpu"))
    weights, ids = route(reference, w, s)
    probs = router_probs(w, s)
    other = ids.clone()
    other[:2, -1] = probs[:2].argmin(dim=1)  # 2 of 64 tokens take their least likely expert
    with pytest.raises(AssertionError, match="2 of 64 tokens picked another expert set"):
        assert_same_experts((weights, other), (weights, ids), probs)
    swapped = weights[:, [1, 0, 2, 3]]  # right experts, weights on the wrong ones
    with pytest.raises(AssertionError, match="not close"):
        assert_same_experts((swapped, ids), (weights, ids), probs)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("num_tokens", [256, 4096])
def test_moe_real_shapes_bf16_on_gpu(num_tokens: int) -> None:
    s = MoeShape(num_tokens, 2816, 128, 8, 704)
    w = make_layer(s, torch.device("cuda"), torch.bfloat16)
    want_w, want_ids = route(reference, w, s)
    assert_same_experts(route(triton_moe, w, s), (want_w, want_ids), router_probs(w, s))
    args = (w["hidden"], w["gate_up"], w["down"], want_w, want_ids)
    got, want = triton_moe.fused_moe(*args), reference.fused_moe(*args)
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
