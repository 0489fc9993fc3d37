"""Native CPU kernels that fuse what the twins run as separate calls, each against the calls it
replaces, bit for bit: the dense MLP's gate and up projections with GeGLU
(`kernels.native.moe.gated_linear`), attention's q/k/v projections in one pass
(`kernels.native.moe.linear_many`) and the sampler's Philox numbers
(`kernels.native.step.philox_uniform`)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference, reference_layer
from kernels.native import moe as native_moe
from kernels.native import step as native_step
from kernels.native.packing import PackedWeights
from tests.kernels.native_cases import NATIVE

pytestmark = NATIVE


def _lanes() -> int:
    lanes = native_moe.moe_lanes()
    if lanes == 0:
        pytest.skip("no native library")
    return lanes


def _three_calls(x, gate, up, activation):
    gate_out = native_moe.linear(x, gate, None)
    return native_step.gated_act(gate_out, native_moe.linear(x, up, None), activation)


@pytest.mark.parametrize("rows", [128, 131, 512, 1000])
@torch.no_grad()
def test_gated_linear_gives_the_bits_of_linear_linear_and_geglu(rows):
    """Rows off the tile height included; near the twins' composition (F.linear, F.linear,
    ATen's GELU); a weight changed in place is repacked."""
    inter = 4 * _lanes()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=g)
    gate, up = (torch.randn(inter, 96, generator=g) * 96**-0.5 for _ in range(2))
    got = native_moe.gated_linear(x, gate, up, "gelu_pytorch_tanh", [rows])
    assert got.shape == (1, rows, inter)
    assert torch.equal(got, _three_calls(x, gate, up, "gelu_pytorch_tanh"))
    twin = reference_layer.gated_act(
        reference.linear(x, gate, [rows]), reference.linear(x, up, [rows]), "gelu_pytorch_tanh"
    )
    torch.testing.assert_close(got, twin, rtol=1e-5, atol=1e-5)
    up.mul_(-1.0)
    assert torch.equal(
        native_moe.gated_linear(x, gate, up, "gelu_pytorch_tanh", [rows]),
        _three_calls(x, gate, up, "gelu_pytorch_tanh"),
    )


@torch.no_grad()
def test_gated_linear_leaves_other_cases_to_the_three_calls():
    """SiLU, fewer rows than the tiles take, an intermediate size off the vector blocks, and
    autograd: the same values as the calls it replaces (the twins under autograd)."""
    lanes = _lanes()
    g = torch.Generator().manual_seed(0)
    cases = [
        ("silu", native_moe.MIN_LINEAR_ROWS, 2 * lanes),
        ("gelu_pytorch_tanh", native_moe.MIN_LINEAR_ROWS - 1, 2 * lanes),
        ("gelu_pytorch_tanh", 200, 2 * lanes + 1),
    ]
    for activation, rows, inter in cases:
        x = torch.randn(rows, 64, generator=g)
        gate, up = torch.randn(inter, 64, generator=g), torch.randn(inter, 64, generator=g)
        got = native_moe.gated_linear(x, gate, up, activation, [rows])
        assert torch.equal(got, _three_calls(x, gate, up, activation))
    with torch.enable_grad():
        x = torch.randn(200, 64, generator=g, requires_grad=True)
        gate, up = torch.randn(2 * lanes, 64), torch.randn(2 * lanes, 64)
        got = native_moe.gated_linear(x, gate, up, "gelu_pytorch_tanh", [200])
        got.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("rows", [128, 300, 512])
@pytest.mark.parametrize("blocks", [(8, 4, 4), (16, 4), (2, 2, 6)])
@torch.no_grad()
def test_linear_many_gives_each_projections_own_bits(rows, blocks):
    """Two or three weights packed together: each output equals `linear` of its weight alone,
    in its own contiguous tensor."""
    lanes = _lanes()
    g = torch.Generator().manual_seed(rows + len(blocks))
    x = torch.randn(1, rows, 80, generator=g)
    weights = [torch.randn(b * 2 * lanes, 80, generator=g) * 0.1 for b in blocks]
    got = native_moe.linear_many(x, weights, [rows])
    assert len(got) == len(weights)
    for out, weight in zip(got, weights, strict=True):
        assert out.shape == (1, rows, weight.shape[0]) and out.is_contiguous()
        assert torch.equal(out, native_moe.linear(x, weight, [rows]))
    weights[1].mul_(3.0)
    again = native_moe.linear_many(x, weights, [rows])
    assert torch.equal(again[1], native_moe.linear(x, weights[1], [rows]))


@torch.no_grad()
def test_linear_many_falls_back_to_one_linear_each():
    """Few rows, a width off the vector blocks, one weight alone, or four: `linear` each."""
    lanes = _lanes()
    g = torch.Generator().manual_seed(1)
    cases = [
        (native_moe.MIN_LINEAR_ROWS - 1, [2 * lanes, 2 * lanes]),
        (200, [2 * lanes, 2 * lanes + 3]),
        (200, [2 * lanes]),
        (200, [2 * lanes] * 4),
    ]
    for rows, widths in cases:
        x = torch.randn(rows, 48, generator=g)
        weights = [torch.randn(n, 48, generator=g) for n in widths]
        got = native_moe.linear_many(x, weights, [rows])
        for out, weight in zip(got, weights, strict=True):
            assert torch.equal(out, native_moe.linear(x, weight, [rows]))


def test_native_philox_is_the_twins_stream_bit_for_bit():
    """Full 64-bit seeds and counters (negative int64 included), broadcast shapes, and the
    empty case; the fast CPU kernel set binds it."""
    g = torch.Generator().manual_seed(0)
    for seed_shape, counter_shape in [((512,), (512,)), ((16, 1), (16, 32)), ((1,), (7,))]:
        seeds = torch.randint(-(2**63), 2**63 - 1, seed_shape, dtype=torch.int64, generator=g)
        counters = torch.randint(-(2**63), 2**63 - 1, counter_shape, dtype=torch.int64, generator=g)
        got = native_step.philox_uniform(seeds, counters)
        assert got.dtype == torch.float32
        assert torch.equal(got, reference.philox_uniform(seeds, counters))
    small = torch.arange(5, dtype=torch.int64)
    want = reference.philox_uniform(small, small)
    assert torch.equal(native_step.philox_uniform(small, small), want)
    empty = torch.zeros(0, dtype=torch.int64)
    assert native_step.philox_uniform(empty, empty).shape == (0,)
    fast = kernels.resolve_kernels("cpu")
    assert fast.philox_uniform is native_step.philox_uniform
    assert fast.gated_linear is native_moe.gated_linear
    assert fast.linear_many is native_moe.linear_many
    exact = kernels.resolve_kernels("cpu", exact=True)
    assert exact.gated_linear is None and exact.linear_many is None


@torch.inference_mode()
def test_a_forward_on_the_fused_projections_has_the_unfused_bits(tiny_checkpoint):
    """The engine's forward over enough tokens for the tiles (a prefill of 150 and 170 tokens,
    then a canvas each): with `gated_linear` and `linear_many` bound, every output and KV pool
    has the bits it has with `linear` per projection and `gated_act` (q, k and v each reach
    their own place; full layers' v is k)."""
    from dataclasses import replace

    from engine.model import Mode, load_model
    from tests.kernels.native_cases import Sequences

    _lanes()
    path = tiny_checkpoint("c16")
    outs = []
    for fused in (True, False):
        model = load_model(path, kernels="auto")
        ks = model.layers[0].self_attn.kernels
        assert ks.native and ks.gated_linear is not None and ks.linear_many is not None
        if not fused:
            model.bind_kernels(replace(ks, gated_linear=None, linear_many=None))
        cfg, length = model.cfg, model.config.canvas_length
        gen = torch.Generator().manual_seed(3)
        lens = [150, 170]
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
        canvas = torch.randint(0, cfg.vocab_size, (2, length), generator=gen)
        seqs = Sequences(model, 2, max(lens) + length)
        prefill = [seqs.row(i, Mode.ENCODE, 0, lens[i]) for i in range(2)]
        out = [seqs.run(prefill, torch.cat(prompts))]
        dec = [seqs.row(i, Mode.DECODE, lens[i], length) for i in range(2)]
        out.append(model.logits(seqs.run(dec, canvas.flatten())))
        outs.append(out + seqs.cache.keys + seqs.cache.values)
    for got, want in zip(*outs, strict=True):
        assert torch.equal(got, want)


@torch.no_grad()
def test_a_weight_packed_alone_and_in_a_group_keeps_both_copies():
    """`linear` packs q alone and `linear_many` packs it with k: both packed copies stay in the
    binding's store (neither call repacks after the other), and each model bound gets a store
    of its own (`KernelSet.for_model`), so the copies go with the model's kernels."""
    lanes = _lanes()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 64, generator=g)
    q, k = torch.randn(2 * lanes, 64, generator=g), torch.randn(2 * lanes, 64, generator=g)
    packs = PackedWeights()
    native_moe.linear(x, q, None, packs)
    native_moe.linear_many(x, [q, k], None, packs)
    first = {key: held[2] for key, held in packs.copies.items()}
    assert len(first) == 2
    native_moe.linear(x, q, None, packs)
    native_moe.linear_many(x, [q, k], None, packs)
    assert packs.copies.keys() == first.keys()
    assert all(packs.copies[key][2] is copy for key, copy in first.items())
    fast = kernels.resolve_kernels("cpu")
    one, two = fast.for_model(), fast.for_model()
    assert one.linear.keywords["packs"] is not two.linear.keywords["packs"]
    assert one.fused_moe.keywords["packs"] is one.route_experts.keywords["packs"]


@torch.no_grad()
def test_the_router_follows_its_projection_when_it_changes():
    """The router's transposed projection is packed once and repacked when the weight changes
    in place (a loaded checkpoint); experts of the transposed scores match the twin's."""
    g = torch.Generator().manual_seed(4)
    x, scale = torch.randn(64, 48, generator=g), torch.rand(48, generator=g) + 0.5
    proj, pes = torch.randn(20, 48, generator=g), torch.rand(20, generator=g) + 0.5
    packs = PackedWeights()
    for _ in range(2):
        weights, ids = native_step.route_experts(x, scale, proj, pes, 3, 1e-6, packs=packs)
        assert len(packs.copies) == 1  # one copy of the one projection, made again in place
        want_w, want_ids = reference.route_experts(x, scale, proj, pes, 3, 1e-6)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
        proj.mul_(-1.0)
