"""The native CPU kernels (`kernels/native/sampler.c`, `norms.c`, `moe.c`) against their twins,
and the fallback to the twins."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch

import kernels
from kernels import reference, reference_layer
from kernels.native import attention as native_attention
from kernels.native import build, norms, sampler
from kernels.native import moe as native_moe
from kernels.native import step as native_step
from kernels.native import threads as native_threads
from kernels.native.packing import PackedWeights
from tests.kernels.native_cases import NATIVE, TOL, forwards

pytestmark = NATIVE


def _inputs(num_positions: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_positions, vocab, generator=g) * 4
    temperature = torch.rand(num_positions, generator=g) * 1.5 + 0.05
    uniform = torch.rand(num_positions, generator=g)
    return logits, temperature, uniform


def _cdf_gap(logits, temperature, uniform, tokens) -> torch.Tensor:
    """How far, in probability, the twin's inverse CDF puts u from the boundary that separates
    the twin's token from `tokens` (0 where they agree)."""
    probs = torch.softmax(logits.double() / temperature.double()[:, None], -1)
    cdf = probs.cumsum(-1)
    target = uniform.double() * cdf[:, -1]
    lo = torch.minimum(tokens, reference.fused_sample(logits, temperature, uniform).sample)
    return (cdf.gather(1, lo[:, None])[:, 0] - target).abs()


@pytest.mark.parametrize("num_positions,vocab", [(1, 1), (5, 7), (33, 513), (64, 8192)])
def test_matches_the_twin(num_positions, vocab):
    logits, temperature, uniform = _inputs(num_positions, vocab, seed=vocab)
    want = reference.fused_sample(logits, temperature, uniform)
    got = sampler.fused_sample(logits, temperature, uniform)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-5)
    differ = got.sample != want.sample
    # Both are inverse-CDF draws of the same u; they may part only at a rounding of a boundary.
    assert (_cdf_gap(logits, temperature, uniform, got.sample)[differ] < 1e-5).all()
    assert differ.float().mean() <= 0.02


def test_soft_embedding_matches_the_twin():
    logits, temperature, uniform = _inputs(48, 1000, seed=1)
    weight = torch.randn(1000, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    want, want_soft = reference.sample_and_embed(logits, temperature, uniform, weight, 8.0)
    got, got_soft = sampler.sample_and_embed(logits, temperature, uniform, weight, 8.0)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got_soft, want_soft, rtol=1e-5, atol=1e-6)
    bf16 = weight.to(torch.bfloat16)
    _, soft16 = sampler.sample_and_embed(logits, temperature, uniform, bf16, 8.0)
    assert soft16.dtype == torch.bfloat16
    torch.testing.assert_close(soft16.float(), want_soft, rtol=2e-2, atol=2e-2)


def test_rows_do_not_depend_on_their_batch():
    logits, temperature, uniform = _inputs(40, 300, seed=3)
    whole = sampler.fused_sample(logits, temperature, uniform)
    for i in (0, 17, 39):
        alone = sampler.fused_sample(logits[i : i + 1], temperature[i : i + 1], uniform[i : i + 1])
        for field in ("sample", "argmax", "entropy", "lse"):
            assert torch.equal(getattr(alone, field)[0], getattr(whole, field)[i]), (i, field)


def test_non_finite_and_masked_rows():
    vocab = 64
    logits = torch.randn(6, vocab)
    logits[0, 5] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    logits[3, :60] = float("-inf")  # a grammar mask: only the last 4 tokens are allowed
    logits[4] = -1e30
    logits[4, 11] = 0.0  # one token carries all the mass
    logits[5, 20] = 1e4  # peaked by value
    uniform = torch.tensor([0.5, 0.5, 0.5, 0.999, 0.999, 0.0])
    got = sampler.fused_sample(logits, torch.ones(6), uniform)
    want = reference.fused_sample(logits, torch.ones(6), uniform)
    assert torch.isnan(got.lse[:3]).all() and torch.isnan(want.lse[:3]).all()
    assert torch.isfinite(got.lse[3:]).all()
    assert int(got.sample[3]) >= 60 and int(got.argmax[3]) >= 60
    assert int(got.sample[4]) == 11 and float(got.entropy[4]) == 0.0
    assert int(got.sample[5]) == 20 == int(got.argmax[5])
    assert torch.equal(got.sample[3:], want.sample[3:])
    torch.testing.assert_close(got.lse[3:], want.lse[3:])


def test_draws_follow_the_distribution():
    """20,000 positions of one 8-token distribution: the counts of the draws fit its
    probabilities (chi-square, 7 degrees of freedom, p > 0.001)."""
    num = 20_000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    logits = row.expand(num, -1).contiguous()
    uniform = torch.rand(num, generator=torch.Generator().manual_seed(4))
    got = sampler.fused_sample(logits, torch.full((num,), 0.8), uniform)
    expected = torch.softmax(row.double() / 0.8, -1) * num
    counts = torch.bincount(got.sample, minlength=8).double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, chi2  # the 0.999 quantile of chi-square(7)


def test_fast_cpu_kernels_bind_them_and_others_do_not():
    fast = kernels.resolve_kernels("cpu")
    assert fast.native and fast.sample_and_embed is sampler.sample_and_embed
    assert fast.close_layer is norms.close_layer and fast.rms_norm is norms.rms_norm
    assert fast.route_experts is native_step.route_experts
    assert fast.qkv_norm_rope is native_step.qkv_norm_rope
    assert fast.gated_act is native_step.gated_act
    assert fast.canvas_attention is native_attention.canvas_attention
    assert fast.backend == "native" and fast.describe() == "fast numerics, native kernels"
    assert not kernels.resolve_kernels("cpu", "twins").native
    assert not kernels.resolve_kernels("cpu", exact=True).native
    assert not fast.with_custom_ops().native


def test_without_a_compiler_the_twins_stay(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "canvas-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="kernels.native.build"):
        ks = kernels.resolve_kernels("cpu")
    assert not ks.native and ks.sample_and_embed is reference.sample_and_embed
    assert ks.backend == "twins"  # auto names what it bound
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="'native' needs the C kernels"):
        kernels.resolve_kernels("cpu", "native")
    build.library.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("CANVAS_NATIVE", "0")
    assert not kernels.resolve_kernels("cpu").native


def test_a_failing_build_says_why(tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        build.build(broken, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))


NORM_SHAPES = [(1, 1, 7), (3, 5, 64), (1, 300, 256), (16, 260)]


def _norm_inputs(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    return [torch.randn(*shape, generator=g) for _ in range(3)] + [
        torch.randn(hidden, generator=g) for _ in range(3)
    ]


@pytest.mark.parametrize("shape", NORM_SHAPES)
@torch.inference_mode()
def test_norms_match_their_twins(shape):
    x, r, d, wa, wb, w = _norm_inputs(shape, seed=len(shape) * 100 + shape[-1])
    close = dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(
        norms.rms_norm(x, wa, 1e-6), reference.rms_norm(x, wa, 1e-6), **close
    )
    torch.testing.assert_close(
        norms.rms_norm(x, None, 1e-6), reference.rms_norm(x, None, 1e-6), **close
    )
    torch.testing.assert_close(
        norms.add_rms_norm(r, x, wa, 1e-6),
        reference.add_rms_norm_exact(r, x, wa, 1e-6),
        **close,
    )
    for got, want in zip(
        norms.rms_norm_pair(x, wa, wb, 1e-6),
        reference.rms_norm_pair_exact(x, wa, wb, 1e-6),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **close)
    rows = x.numel() // shape[-1]
    for scale in (torch.tensor([0.7]), torch.rand(rows).view(*shape[:-1], 1) + 0.5):
        got = norms.close_layer(d, x, r, wa, wb, w, scale, 1e-6)
        want = reference.close_layer_exact(d, x, r, wa, wb, w, scale, 1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_norm_row_does_not_depend_on_its_batch():
    x, r, d, wa, wb, w = _norm_inputs((64, 200), seed=9)
    scale = torch.rand(64, 1) + 0.5
    whole = norms.close_layer(d, x, r, wa, wb, w, scale, 1e-6)
    whole_norm = norms.rms_norm(x, wa, 1e-6)
    for i in (0, 31, 63):
        rows = slice(i, i + 1)
        alone = norms.close_layer(d[rows], x[rows], r[rows], wa, wb, w, scale[rows], 1e-6)
        assert torch.equal(alone, whole[rows])
        assert torch.equal(norms.rms_norm(x[rows], wa, 1e-6), whole_norm[rows])


def test_norms_leave_autograd_and_other_dtypes_to_the_twins():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(16)
    out = norms.rms_norm(x, w, 1e-6)  # grad mode: the twin, differentiable
    out.sum().backward()
    assert x.grad is not None
    half = torch.randn(4, 16, dtype=torch.float16)  # bf16: the bf16 kernels (test_native_bf16)
    with torch.inference_mode():
        got = norms.rms_norm(half, w.half(), 1e-6)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, reference.rms_norm(half, w.half(), 1e-6))


@torch.inference_mode()
def test_a_fast_forward_on_native_kernels_stays_near_the_twins(tiny_checkpoint):
    """The engine's fast forward (prefill, a mixed canvas + commit forward, the decoder's
    logits, the KV pools) with the native norms against the twins'."""
    from engine.model import load_model

    path = tiny_checkpoint("c16")
    native = load_model(path, kernels="auto")
    assert native.layers[0].self_attn.kernels.native
    got, want = forwards(native), forwards(load_model(path, kernels="twins"))
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(w).all()
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


# -- an AR step's few rows: the router, the per-head norms, the one-token experts -------------


def _moe_layer(num_tokens: int, hidden: int, experts: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(num_tokens, hidden, generator=g),
        "scale": torch.rand(hidden, generator=g) + 0.5,
        "proj": torch.randn(experts, hidden, generator=g),
        "per_expert_scale": torch.rand(experts, generator=g) + 0.5,
        "gate_up": torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5,
        "down": torch.randn(experts, hidden, inter, generator=g) * inter**-0.5,
    }


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 2), (5, 3), (40, 2)])
@torch.inference_mode()
def test_the_router_matches_its_twin(num_tokens, top_k):
    w = _moe_layer(num_tokens, 48, 12, 16, seed=num_tokens * 10 + top_k)
    args = (w["hidden"], w["scale"], w["proj"], w["per_expert_scale"], top_k, 1e-6)
    got_weights, got_ids = native_step.route_experts(*args, segments=[num_tokens])
    want_weights, want_ids = reference.route_experts(*args)
    assert torch.equal(got_ids, want_ids)  # random scores: no near-ties at this size
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-5, atol=1e-6)
    with torch.enable_grad():  # training keeps the twin
        assert torch.equal(native_step.route_experts(*args)[0], want_weights)


@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 8, 4), (7, 4, 1)])
@torch.inference_mode()
def test_qkv_norms_and_rope_match_their_twin(tokens, heads, kv_heads):
    g, dim = torch.Generator().manual_seed(tokens), 32
    q = torch.randn(tokens, heads, dim, generator=g)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=g) for _ in range(2))
    qw, kw = torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5
    angle = torch.rand(tokens, dim // 2, generator=g) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    got = native_step.qkv_norm_rope(q, k, v, qw, kw, cos, sin, 1e-6)
    want = reference.qkv_norm_rope(q, k, v, qw, kw, cos, sin, 1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@torch.inference_mode()
def test_operands_of_the_wrong_shape_reach_the_twins_and_their_errors():
    """The C kernels index by the shapes they are given: mismatched operands go to the twins,
    which refuse them, instead of being read out of bounds."""
    w = _moe_layer(6, 48, 12, 16, seed=1)
    bad_scale = (w["hidden"], w["scale"][:5], w["proj"], w["per_expert_scale"], 2, 1e-6)
    with pytest.raises(RuntimeError):
        reference.route_experts(*bad_scale)
    with pytest.raises(RuntimeError):
        native_step.route_experts(*bad_scale)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 4, 32, generator=g), torch.randn(3, 2, 16, generator=g)
    cos = sin = torch.ones(3, 32)
    args = (q, k, k, torch.ones(32), torch.ones(16), cos, sin, 1e-6)
    with pytest.raises(RuntimeError):
        reference.qkv_norm_rope(*args)
    with pytest.raises(RuntimeError):
        native_step.qkv_norm_rope(*args)


@pytest.mark.parametrize("shape", [(1, 7), (5, 192), (3, 37)])
@torch.inference_mode()
def test_geglu_matches_its_twin_and_other_activations_keep_it(shape):
    g = torch.Generator().manual_seed(shape[-1])
    gate = torch.randn(shape, generator=g) * 4
    gate.view(-1)[:3] = torch.tensor([-200.0, 200.0, 0.0])  # past the exp's clamp, and 0
    up = torch.randn(shape, generator=g)
    want = reference_layer.gated_act(gate, up, "gelu_pytorch_tanh")
    got = native_step.gated_act(gate, up, "gelu_pytorch_tanh")
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    silu = native_step.gated_act(gate, up, "silu")
    assert torch.equal(silu, reference_layer.gated_act(gate, up, "silu"))


@pytest.mark.parametrize("top_k", [1, 2, 4])
@torch.inference_mode()
def test_one_token_experts_give_the_grouped_paths_bits(top_k):
    """`fused_moe_scattered` at one token runs its experts directly; each expert sees the same
    single row as in the grouped GEMMs, so the sum is the grouped path's, bit for bit."""
    w = _moe_layer(1, 64, 8, 24, seed=top_k)
    for trial in range(5):
        hidden = torch.randn(1, 64, generator=torch.Generator().manual_seed(trial))
        weights = torch.rand(1, top_k) + 0.1
        ids = torch.randperm(8, generator=torch.Generator().manual_seed(trial))[:top_k][None]
        out, perm = reference._expert_outputs(hidden, w["gate_up"], w["down"], weights, ids)
        grouped = out.new_zeros(1, 64).index_add_(0, perm // top_k, out)
        got = reference.fused_moe_scattered(hidden, w["gate_up"], w["down"], weights, ids)
        assert torch.equal(got, grouped)


@pytest.mark.parametrize("hidden,inter,top_k", [(64, 24, 1), (48, 16, 4), (44, 20, 2)])
@torch.inference_mode()
def test_native_one_token_experts_match_the_twin(hidden, inter, top_k):
    """`moe.c` at one token (sizes off the 8-wide vectors exercise the tails; the twin's grouped
    GEMM needs rows of whole 16 bytes), and the twin beyond one token."""
    w = _moe_layer(3, hidden, 8, inter, seed=hidden)
    weights = torch.rand(3, top_k, generator=torch.Generator().manual_seed(1)) + 0.1
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:top_k]
                       for i in range(3)])  # fmt: skip
    for rows in (slice(0, 1), slice(1, 2), slice(0, 3)):
        args = (w["hidden"][rows], w["gate_up"], w["down"], weights[rows], ids[rows])
        want = reference.fused_moe_scattered(*args)
        got = native_moe.fused_moe(*args, segments=[args[0].shape[0]])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got.shape == want.shape and got.dtype == want.dtype
    assert kernels.resolve_kernels("cpu").fused_moe is native_moe.fused_moe


# -- many tokens: moe.c's tiled expert products --------------------------------------------------


@pytest.mark.parametrize(
    "num_tokens,hidden,inter,experts,top_k",
    # bench-tiny's experts at a canvas step; tails of a tile (rows not a multiple of the tile,
    # one-row experts, idle experts); bench-small's; a wide intermediate
    [(512, 256, 64, 16, 4), (37, 64, 32, 8, 2), (5, 64, 32, 12, 3), (70, 128, 96, 4, 1)],
)
@torch.inference_mode()
def test_tiled_experts_match_the_twin(num_tokens, hidden, inter, experts, top_k):
    w = _moe_layer(num_tokens, hidden, experts, inter, seed=num_tokens)
    g = torch.Generator().manual_seed(num_tokens + 1)
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
    args = (w["hidden"], w["gate_up"], w["down"], weights, ids)
    want = reference.fused_moe_scattered(*args)
    got = native_moe.fused_moe(*args, segments=[num_tokens])
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    # the tiled path ran (not the twin), and its rows never depend on their batch
    assert native_moe.tiles(w["gate_up"], w["down"])
    alone = native_moe.fused_moe(*(a[:3] if a.dim() == 2 else a for a in args))
    assert torch.equal(alone, got[:3])


@pytest.mark.parametrize("bad", [-1, 8])
@torch.inference_mode()
def test_tiled_experts_refuse_an_id_that_is_no_expert(bad):
    w = _moe_layer(20, 64, 8, 32, seed=3)
    ids = torch.zeros(20, 2, dtype=torch.int64)
    ids[7, 1] = bad
    with pytest.raises(IndexError, match=r"expert ids must be in \[0, 8\)"):
        native_moe.fused_moe(w["hidden"], w["gate_up"], w["down"], torch.ones(20, 2), ids)


@torch.no_grad()
def test_tiled_experts_follow_their_weights_and_keep_gelus_range():
    """The packed weights are rebuilt when the weights (model parameters: not inference
    tensors) change in place, as a loaded checkpoint does, and the GELU holds at large |x| (its
    exp is clamped, never inf/inf)."""
    w = _moe_layer(24, 64, 4, 32, seed=3)
    weights, ids = torch.full((24, 2), 0.5), torch.tensor([[0, 1], [2, 3]] * 12)
    args = (w["hidden"], w["gate_up"], w["down"], weights, ids)
    packs = PackedWeights()  # a bound model's store
    native_moe.fused_moe(*args, packs=packs)
    w["gate_up"].mul_(-40.0)  # pre-activations of +-hundreds: GELU's both tails
    w["down"].add_(0.25)
    got = native_moe.fused_moe(*args, packs=packs)
    want = reference.fused_moe_scattered(*args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


def test_large_experts_take_the_twin():
    """Experts beyond the L2 budget, or off the vector blocks, are not tiled."""
    lanes = native_moe.moe_lanes()
    if lanes == 0:
        pytest.skip("no native library")
    big = torch.empty(1, 2 * 512, 1024), torch.empty(1, 1024, 512)
    assert not native_moe.tiles(*big)
    odd = torch.empty(1, 2 * (lanes + 1), 64), torch.empty(1, 64, lanes + 1)
    assert not native_moe.tiles(*odd)
    assert native_moe.tiles(torch.empty(1, 2 * lanes, 4 * lanes), torch.empty(1, 4 * lanes, lanes))


@torch.inference_mode()
def test_tiled_experts_split_on_torchs_team_or_our_threads_alike(monkeypatch):
    """Built with OpenMP, `moe.c` must share torch's runtime (one mapped: a second team would
    fight torch's workers for the cores); its rows split on that team or, without it, on our
    Python threads give the same bits (each pair's row is computed alone, and summed in slot
    order either way)."""
    lib = build.library("moe")
    if lib is None:
        pytest.skip("no native library")
    if lib.canvas_moe_openmp():
        assert build.one_openmp_runtime()
        assert build.on_torch_team("moe")
    w = _moe_layer(300, 128, 8, 32, seed=5)
    g = torch.Generator().manual_seed(6)
    weights = torch.rand(300, 2, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(300)])
    args = (w["hidden"], w["gate_up"], w["down"], weights, ids)
    team = native_moe.fused_moe(*args)
    monkeypatch.setattr(native_moe, "on_torch_team", lambda name: False)
    assert torch.equal(native_moe.fused_moe(*args), team)


@torch.inference_mode()
def test_rows_split_on_torchs_team_or_our_threads_alike(monkeypatch):
    """The norms and the sampler split their rows on torch's OpenMP team where the libraries
    were built with OpenMP (sharing torch's runtime), else on Python threads: the same bits
    either way (rows are independent), and every row is written (ranges cover them all)."""
    g = torch.Generator().manual_seed(7)
    x, res = torch.randn(1031, 256, generator=g), torch.randn(1031, 256, generator=g)
    w, w2 = torch.rand(256, generator=g) + 0.5, torch.rand(256, generator=g) + 0.5
    logits = torch.randn(61, 300, generator=g) * 3
    temperature, uniform = torch.full((61,), 0.7), torch.rand(61, generator=g)

    def run():
        sample = sampler.fused_sample(logits, temperature, uniform)
        return [
            norms.rms_norm(x, w, 1e-6),
            norms.add_rms_norm(res, x, w, 1e-6),
            *norms.rms_norm_pair(x, w, w2, 1e-6),
            norms.close_layer(x, res, x, w, w2, w, torch.rand(1031, generator=g), 1e-6),
            sample.sample, sample.argmax, sample.entropy, sample.lse,
        ]  # fmt: skip

    g.manual_seed(8)
    team = run()
    torch.testing.assert_close(team[0], reference.rms_norm_fused(x, w, 1e-6))
    monkeypatch.setattr(native_threads, "on_torch_team", lambda name: False)
    g.manual_seed(8)
    for got, want in zip(run(), team, strict=True):
        assert torch.equal(got, want)


@torch.inference_mode()
def test_any_number_of_ranges_per_thread_gives_the_same_bits():
    """The team's threads take ranges of rows as they come free (`canvas_chunks` per thread,
    parallel.h): one range each (static halves) or many, every row is written once, with the
    same bits (a row's values never depend on the rows it is grouped with)."""
    if not build.on_torch_team("moe"):
        pytest.skip("the libraries are not on torch's OpenMP team here")
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(517, 256, generator=g), torch.rand(256, generator=g) + 0.5
    weight, layer = torch.randn(192, 256, generator=g), _moe_layer(517, 256, 16, 64, seed=5)
    weights = torch.rand(517, 4, generator=g)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(517)])
    libs = [build.library(name) for name in build.SIGNATURES]
    chunks = [ctypes.c_int64.in_dll(lib, "canvas_chunks") for lib in libs]
    before = [c.value for c in chunks]
    threads = torch.get_num_threads()
    outs = []
    try:
        torch.set_num_threads(2)
        for n in (1, 4, 13):
            for c in chunks:
                c.value = n
            outs.append([
                norms.rms_norm(x, w, 1e-6),
                native_moe.linear(x, weight, [517]),
                native_moe.fused_moe(x, layer["gate_up"], layer["down"], weights, ids),
                native_step.gated_act(x, x, "gelu_pytorch_tanh"),
            ])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        for c, value in zip(chunks, before, strict=True):
            c.value = value
    for other in outs[1:]:
        for got, want in zip(other, outs[0], strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("rows,k,n", [(512, 256, 192), (131, 64, 96), (300, 40, 64)])
@torch.no_grad()
def test_dense_tiles_match_the_twin_and_never_depend_on_the_batch(rows, k, n):
    """`native_moe.linear` (packed weights, register tiles) against F.linear, rows off the tile
    height included; a row's bits are the same in any batch of at least MIN_LINEAR_ROWS rows;
    an in-place change of the weight (a loaded checkpoint) repacks it."""
    lanes = native_moe.moe_lanes()
    if lanes == 0 or n % (2 * lanes):
        pytest.skip("no native library, or N off this machine's vector blocks")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, k, generator=g)
    weight = torch.randn(n, k, generator=g) * k**-0.5
    got = native_moe.linear(x, weight, [rows])
    assert got.shape == (1, rows, n)
    torch.testing.assert_close(got, reference.linear(x, weight, [rows]), rtol=1e-5, atol=1e-5)
    more = torch.cat([x, torch.randn(1, 70, k, generator=g)], 1)
    assert torch.equal(native_moe.linear(more, weight, [rows + 70])[:, :rows], got)
    weight.mul_(-2.0)
    torch.testing.assert_close(native_moe.linear(x, weight, [rows]), -2 * got, rtol=1e-5, atol=1e-5)
    assert kernels.resolve_kernels("cpu").linear is native_moe.linear


@torch.no_grad()
def test_few_rows_large_or_odd_weights_take_blas():
    """Below MIN_LINEAR_ROWS rows (an AR step), beyond MAX_PACKED_LINEAR_BYTES, or with N off
    the vector blocks, `linear` is the twin's F.linear, bit for bit."""
    g = torch.Generator().manual_seed(0)
    cases = [(native_moe.MIN_LINEAR_ROWS - 1, 64, 64), (200, 1024, 512), (200, 64, 20)]
    for rows, k, n in cases:
        x, weight = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        assert torch.equal(
            native_moe.linear(x, weight, [rows]), torch.nn.functional.linear(x, weight)
        )
