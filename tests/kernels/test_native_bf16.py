"""The native bf16 kernels (`kernels/native/bf16.c`, `bf16_amx.h`) against their bf16 twins on
every path this machine has (the generic one always), rows independent of their batch, and the
routing of bf16 operands from `kernels.native.moe`."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine.model import Mode
from kernels import reference, reference_layer, reference_norm
from kernels.native import attention as native_attention
from kernels.native import bf16, norms, step
from kernels.native import moe as native_moe
from kernels.native.packing import PackedWeights
from tests.kernels.attention_cases import SCENARIOS, make_inputs, run
from tests.kernels.native_cases import NATIVE

pytestmark = NATIVE
# bf16 outputs: within a few of their last bits (8 significant bits) of the twin's.
RTOL, ATOL = 2e-2, 2e-2


def each_path() -> list[str]:
    """Every path named in `bf16.PATHS`; a test on one this machine lacks skips."""
    return list(bf16.PATHS)


@pytest.fixture(params=each_path())
def path(request, monkeypatch) -> str:
    if request.param not in bf16.paths():
        pytest.skip(f"this CPU has no {request.param} path")
    monkeypatch.setenv("CANVAS_NATIVE_BF16", request.param)
    return request.param


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize(
    "rows,k,n",
    [(1, 64, 32), (3, 33, 64), (17, 511, 96), (40, 130, 32), (15, 96, 64), (33, 256, 96)],
)
@torch.no_grad()
def test_dense_tiles_match_the_twin_and_never_depend_on_the_batch(path, rows, k, n):
    x, weight = _randn(rows, k, seed=rows), _randn(n, k, seed=k, scale=k**-0.5)
    (got,) = bf16.linear_tiles(x, [weight], None)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=RTOL, atol=ATOL)
    more = torch.cat([_randn(5, k, seed=1), x, _randn(9, k, seed=2)])
    assert torch.equal(bf16.linear_tiles(more, [weight], None)[0][5 : 5 + rows], got)


@pytest.mark.parametrize("rows", [1, 3, 17])
@torch.no_grad()
def test_split_projections_give_each_its_own_bits(path, rows):
    k = 47
    x = _randn(rows, k, seed=3)
    weights = [_randn(n, k, seed=n, scale=0.2) for n in (64, 32, 96)]
    got = bf16.linear_tiles(x, weights, PackedWeights())
    for out, weight in zip(got, weights, strict=True):
        assert torch.equal(out, bf16.linear_tiles(x, [weight], None)[0])


@pytest.mark.parametrize(
    "rows,k,inter", [(1, 32, 16), (3, 33, 48), (17, 130, 32), (16, 64, 48), (35, 256, 80)]
)
@torch.no_grad()
def test_gated_tiles_match_the_twin_and_never_depend_on_the_batch(path, rows, k, inter):
    x = _randn(rows, k, seed=rows)
    gate, up = (_randn(inter, k, seed=s, scale=k**-0.5) for s in (5, 6))
    got = bf16.gated_tiles(x, gate, up, None)
    want = reference_layer.gated_act(F.linear(x, gate), F.linear(x, up), "gelu_pytorch_tanh")
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    more = torch.cat([x, _randn(11, k, seed=7)])
    assert torch.equal(bf16.gated_tiles(more, gate, up, None)[:rows], got)


def _experts(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hid = _randn(tokens, hidden, seed=seed)
    gate_up = _randn(experts, 2 * inter, hidden, seed=seed + 1, scale=hidden**-0.5)
    down = _randn(experts, hidden, inter, seed=seed + 2, scale=inter**-0.5)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return hid, gate_up, down, weights, ids


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k",
    [(1, 64, 32, 4, 2), (3, 32, 16, 3, 1), (17, 96, 64, 5, 2), (70, 64, 32, 8, 3)],
)
@torch.no_grad()
def test_experts_match_the_twin_and_never_depend_on_the_batch(
    path, tokens, hidden, inter, experts, top_k
):
    """Experts off AMX's blocks of 32 (inter 16) take the vector tiles on the amx path."""
    args = _experts(tokens, hidden, inter, experts, top_k, seed=tokens)
    assert bf16.tiles(args[1], args[2])
    got = bf16.fused_moe(*args, PackedWeights())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference.fused_moe_scattered(*args), rtol=RTOL, atol=ATOL)
    hid, gate_up, down, weights, ids = args
    others = _experts(23, hidden, inter, experts, top_k, seed=99)
    more = [torch.cat([o, a]) for o, a in zip(others, args, strict=True)]
    more[1:3] = gate_up, down
    assert torch.equal(bf16.fused_moe(*more, None)[23:], got)


@torch.no_grad()
def test_the_vector_paths_agree_bit_for_bit_and_amx_within_rounding(monkeypatch):
    """vdpbf16ps adds each input pair's products as the generic path does, both exact in
    fp32: the same bits (no denormals here); AMX sums within the bf16 rounding."""
    have = bf16.paths()
    x, w = _randn(19, 75, seed=1), _randn(64, 75, seed=2, scale=0.1)
    args = _experts(40, 64, 32, 4, 2, seed=5)
    outs = {}
    for name in have:
        monkeypatch.setenv("CANVAS_NATIVE_BF16", name)
        outs[name] = (bf16.linear_tiles(x, [w], None)[0], bf16.fused_moe(*args, None))
    if "avx512_bf16" in have:
        for got, want in zip(outs["avx512_bf16"], outs["generic"], strict=True):
            assert torch.equal(got, want)
    if "amx" in have:
        assert torch.equal(outs["amx"][0], outs["generic"][0])  # dense: vdpbf16ps
        torch.testing.assert_close(outs["amx"][1], outs["generic"][1], rtol=RTOL, atol=ATOL)


def test_the_path_variable_is_checked(monkeypatch):
    monkeypatch.setenv("CANVAS_NATIVE_BF16", "fastest")
    with pytest.raises(ValueError, match="CANVAS_NATIVE_BF16 must be"):
        bf16.path()
    monkeypatch.setenv("CANVAS_NATIVE_BF16", "generic")
    assert bf16.path() == bf16.PATHS["generic"]
    assert "generic" in bf16.paths()
    for name in set(bf16.PATHS) - set(bf16.paths()):
        monkeypatch.setenv("CANVAS_NATIVE_BF16", name)
        with pytest.raises(ValueError, match="has only"):
            bf16.path()


@torch.no_grad()
def test_moe_hands_bf16_operands_to_the_bf16_kernels(monkeypatch):
    """`native_moe`'s kernels take bf16 operands to `bf16` (dense ones to oneDNN where it has
    AMX and the tiles do not run on AMX: `tiles_first`), fp32 ones as before; odd shapes take
    the twins."""
    calls = []
    monkeypatch.setattr(bf16, "linear_tiles", lambda *a: calls.append("linear") or [None])
    monkeypatch.setattr(bf16, "gated_tiles", lambda *a: calls.append("gated"))
    x, w = _randn(200, 64, seed=1), _randn(64, 64, seed=2)
    native_moe.linear(x, w, [200])
    native_moe.gated_linear(x, w, w, "gelu_pytorch_tanh", [200])
    native_moe.linear(x.float(), w.float(), [200])
    first = ["linear", "gated"] if bf16.tiles_first(64, 200) else []
    amx = bf16.amx_dense(64)
    assert calls == first and bf16.tiles_first(64, 200) == (amx or not bf16.onednn_amx())
    assert not bf16.tiles_first(64, bf16.AMX_MAX_ROWS) or not bf16.onednn_amx()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not bf16.onednn_amx() and bf16.tiles_first(64, bf16.AMX_MAX_ROWS)
    native_moe.linear(x, w, [200])
    assert torch.equal(native_moe.linear(x, w[:20], [200]), F.linear(x, w[:20]))
    assert calls == [*first, "linear"]
    args = _experts(9, 48, 16, 3, 2, seed=3)  # hidden off the blocks of 32: the twin
    assert not bf16.tiles(args[1], args[2])
    assert torch.equal(native_moe.fused_moe(*args), reference.fused_moe_scattered(*args))


@pytest.mark.parametrize("rows,hidden", [(1, 32), (3, 37), (17, 200)])
@torch.inference_mode()
def test_bf16_norms_match_their_twins_and_never_depend_on_the_batch(monkeypatch, rows, hidden):
    """The bf16 norms (norms.c's `_bf16` kernels, not the twins: those raise here) round where
    the bf16 twins round: each output within a bf16 rounding of the twin's (the fp32 inverse
    RMS may differ in its last bit); a row's bits the same alone as in its batch."""
    for name in ("rms_norm_fused", "add_rms_norm", "rms_norm_pair", "close_layer"):
        monkeypatch.setattr(reference, name, lambda *a, _n=name: pytest.fail(f"twin {_n}"))
    x, r, d, m = (_randn(rows, hidden, seed=s) for s in range(4))
    wa, wb, w = (_randn(hidden, seed=s, scale=0.5) for s in range(4, 7))
    per_row = (torch.rand(rows, 1) + 0.5).bfloat16()
    outs = {
        "norm": (norms.rms_norm(x, wa, 1e-6), reference_norm.rms_norm_fused(x, wa, 1e-6)),
        "bare": (norms.rms_norm(x, None, 1e-6), reference_norm.rms_norm_fused(x, None, 1e-6)),
        "add": (norms.add_rms_norm(r, x, wa, 1e-6), reference_layer.add_rms_norm(r, x, wa, 1e-6)),
        "pair": (
            torch.cat(norms.rms_norm_pair(x, wa, wb, 1e-6)),
            torch.cat(reference_layer.rms_norm_pair(x, wa, wb, 1e-6)),
        ),
    }
    for scale in (torch.tensor([0.7]).bfloat16(), per_row):
        got = norms.close_layer(d, m, r, wa, wb, w, scale, 1e-6)
        want = reference_layer.close_layer(d, m, r, wa, wb, w, scale, 1e-6)
        outs[f"close {scale.numel()}"] = got, want
    for name, (got, want) in outs.items():
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=name)
    last = slice(rows - 1, rows)
    alone = norms.close_layer(d[last], m[last], r[last], wa, wb, w, per_row[last], 1e-6)
    assert torch.equal(alone, outs[f"close {rows}"][0][last])
    assert torch.equal(norms.rms_norm(x[last], wa, 1e-6), outs["norm"][0][last])


@pytest.mark.parametrize("tokens", [1, 3, 17])
@torch.inference_mode()
@pytest.mark.parametrize("tables", [torch.bfloat16, torch.float32])
def test_bf16_qkv_norms_and_rope_are_native_and_match_the_twin(monkeypatch, tokens, tables):
    """bf16 q/k/v: with bf16 cos and sin step.c's bf16 kernel (the twin raises here), with
    fp32 ones the native bf16 norms (the twin's norm raises) and the twin's RoPE; within a
    bf16 rounding of the twin either way."""
    q, k, v = (_randn(tokens, h, 48, seed=h) for h in (4, 2, 3))
    v = v[:, :2]
    qw, kw = _randn(48, seed=3), _randn(48, seed=4)
    angles = torch.rand(tokens, 24) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(tables) for f in (torch.cos, torch.sin))
    want = reference.qkv_norm_rope(q, k, v, qw, kw, cos, sin, 1e-6)
    monkeypatch.setattr(reference, "rms_norm_fused", lambda *a: pytest.fail("the twin's norm"))
    monkeypatch.setattr(reference, "qkv_norm_rope", lambda *a: pytest.fail("the twin"))
    got = step.qkv_norm_rope(q, k, v, qw, kw, cos, sin, 1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_qkv_norms_read_q_k_v_in_place_from_one_products_columns(dtype):
    """q, k and v as column blocks of one [tokens, (Hq + 2 Hkv) D] product (`bf16.dense_many`'s
    views) go to the kernel as they are, no copy, the bits of contiguous copies."""
    tokens, d = 17, 32
    joined = torch.randn(tokens, (4 + 2 + 2) * d, generator=torch.Generator().manual_seed(0))
    q, k, v = (t.view(tokens, -1, d) for t in joined.to(dtype).split([4 * d, 2 * d, 2 * d], -1))
    assert not q.is_contiguous() and step.heads_contiguous(q) is q
    qw, kw = (torch.rand(d) + 0.5).to(dtype), (torch.rand(d) + 0.5).to(dtype)
    angles = torch.rand(tokens, d // 2) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    got = step.qkv_norm_rope(q, k, v, qw, kw, cos, sin, 1e-6)
    copies = (t.contiguous() for t in (q, k, v))
    want = step.qkv_norm_rope(*copies, qw, kw, cos, sin, 1e-6)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous() and torch.equal(g, w)


@pytest.mark.parametrize("shape", [(1, 7), (3, 16), (17, 45)])
@torch.inference_mode()
def test_bf16_geglu_matches_its_twin(shape):
    """bf16 GeGLU (`bf16.gated_act`, bound through `step.gated_act`) rounds where the twin
    rounds; tails off the vector width included."""
    gate, up = _randn(*shape, seed=1, scale=2.0), _randn(*shape, seed=2)
    got = step.gated_act(gate, up, "gelu_pytorch_tanh")
    want = reference_layer.gated_act(gate, up, "gelu_pytorch_tanh")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert torch.equal(
        step.gated_act(gate, up, "silu"), reference_layer.gated_act(gate, up, "silu")
    )


@torch.inference_mode()
def test_bf16_rounding_is_torchs_on_ties_denormals_and_specials():
    """The kernels' fp32 -> bf16 rounding (vcvtneps2bf16 where the CPU has it, which flushes
    denormals: vectors holding one take the software rounding) gives torch's bits: GeGLU with
    gates past GELU's saturation (gelu(g) = g) leaves bf16(g * up), exact products with ties
    and denormal results in some vectors and not others; NaN stays NaN."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    gate = (torch.rand(n, generator=g) * 90 + 10).bfloat16()
    up = torch.randn(n, generator=g).bfloat16()
    tiny = (torch.randn(n, generator=g) * 1e-39).bfloat16()  # bf16 denormals
    up[: n // 2 : 3] = tiny[: n // 2 : 3]
    up[-16:] = tiny[-16:]
    up[5], up[700] = float("nan"), float("inf")
    product = gate.float() * up.float()
    assert ((product.view(torch.int32) & 0xFFFF) == 0x8000).sum() > 50  # ties
    got = step.gated_act(gate[None], up[None], "gelu_pytorch_tanh")[0]
    want = reference_layer.gated_act(gate[None], up[None], "gelu_pytorch_tanh")[0]
    assert ((want.float().abs() < torch.finfo(torch.float32).tiny) & (want != 0)).sum() > 50
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum() == 1
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 1), (17, 2)])
@torch.inference_mode()
@pytest.mark.parametrize("size", [64, 67])
def test_the_bf16_router_runs_the_native_one_in_fp32(tokens, top_k, size):
    """bf16 router operands: `step.route_experts` reading the bf16 rows into fp32 (a size off
    the vector width too), the same weights and experts as on fp32 operands holding the same
    values, with or without a binding's packed copies."""
    hidden, scale = _randn(tokens, size, seed=1), _randn(size, seed=2) + 1
    proj, pes = _randn(8, size, seed=3), _randn(8, seed=4).abs() + 0.5
    got = step.route_experts(hidden, scale, proj, pes, top_k, 1e-6)
    bound = step.route_experts(hidden, scale, proj, pes, top_k, 1e-6, packs=PackedWeights())
    assert torch.equal(got[0], bound[0]) and torch.equal(got[1], bound[1])
    want = step.route_experts(hidden.float(), scale.float(), proj.float(), pes.float(), top_k, 1e-6)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    twin = reference.route_experts(hidden, scale, proj, pes, top_k, 1e-6)
    torch.testing.assert_close(got[0].sum(-1), twin[0].sum(-1), rtol=RTOL, atol=ATOL)


class NativeAttention:
    write_kv = staticmethod(reference.write_kv)
    canvas_attention = staticmethod(native_attention.canvas_attention)


@pytest.mark.parametrize("name", [n for n, sc in SCENARIOS.items() if not sc.images])
@pytest.mark.parametrize("head_dim", [32, 64])
@torch.inference_mode()
def test_bf16_attention_over_a_bf16_cache_matches_the_twin(monkeypatch, path, name, head_dim):
    """attention.c on bf16 q/k/v and pools (the twin raises here) on each path (amx: AMX
    tiles; the others: rows read into fp32): within bf16's rounding of the bf16 twin, every
    text scenario (decode and encode rows, windows, a query alone)."""
    from dataclasses import replace

    sc = replace(SCENARIOS[name], head_dim=head_dim)
    x = make_inputs(sc, torch.device("cpu"), torch.bfloat16)
    want = run(reference, x, sc)
    monkeypatch.setattr(native_attention.reference, "canvas_attention", pytest.fail)
    got = run(NativeAttention, x, sc)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@torch.inference_mode()
def test_bf16_attention_on_amx_tiles_is_its_own_path_within_rounding(monkeypatch):
    """On AMX the scores and values run on tiles (each softmax weight rounded to bf16): other
    bits than the rows read into fp32, within bf16's rounding of them."""
    from dataclasses import replace

    if "amx" not in bf16.paths():
        pytest.skip("this CPU has no AMX path")
    sc = replace(SCENARIOS["mixed-sliding-window-edge"], head_dim=64)
    x = make_inputs(sc, torch.device("cpu"), torch.bfloat16)
    got = {}
    for name in ("amx", "avx512_bf16"):
        monkeypatch.setenv("CANVAS_NATIVE_BF16", name)
        got[name] = run(NativeAttention, x, sc)
    assert not torch.equal(got["amx"], got["avx512_bf16"])
    torch.testing.assert_close(got["amx"], got["avx512_bf16"], rtol=RTOL, atol=ATOL)


@torch.inference_mode()
def test_a_bf16_forward_on_native_kernels_is_as_near_fp32_as_the_twins(
    tiny_checkpoint, monkeypatch
):
    """A bf16 model on the native backend (`--dtype bfloat16 --device cpu`) runs the bf16
    kernels (its projections too where the tiles go first: on AMX, or where
    ONEDNN_MAX_CPU_ISA caps oneDNN), and its forward (hidden states, logits, KV pools) is as
    near the fp32 forward as the bf16 twins' (a random tiny model amplifies bf16's rounding:
    the twins' own differ by up to ~2). Four tiny models' forwards: the engine's whole bf16
    path, slower than the unit cases."""
    from engine.model import load_model
    from tests.kernels.native_cases import forwards

    path = tiny_checkpoint("c16")
    hidden = json.loads((path / "config.json").read_text())["text_config"]["hidden_size"]
    twins = forwards(load_model(path, dtype="bfloat16", kernels="twins"))
    exact = forwards(load_model(path, dtype="float32", kernels="twins"))
    calls: list[str] = []
    for name in ("linear_tiles", "gated_tiles", "fused_moe"):
        real = getattr(bf16, name)
        monkeypatch.setattr(bf16, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    for isa in ("ALL", "AVX512_CORE_BF16"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        calls.clear()
        got = forwards(load_model(path, dtype="bfloat16", kernels="native"))
        dense = {"linear_tiles", "gated_tiles"} & set(calls)
        assert "fused_moe" in calls and bool(dense) == bf16.tiles_first(hidden, 1)
        for g, t, w in zip(got, twins, exact, strict=True):
            assert g.dtype == t.dtype
            ours, theirs = ((x.float() - w).abs().mean().item() for x in (g, t))
            assert ours <= 1.5 * theirs + 1e-3


@torch.inference_mode()
def test_a_bf16_canvas_gets_the_same_bits_alone_and_among_others(tiny_checkpoint):
    """A bf16 model on the native kernels at bench-tiny's shapes (every dense projection on
    the tiles where they go first, the experts, attention, norms and router native): a
    canvas's hidden states are the same bits in a forward of three canvases as alone (one
    bench-tiny model and four forwards: the shapes where the tiles go first)."""
    from engine.model import load_model
    from tests.kernels.native_cases import Sequences

    path = tiny_checkpoint("bench-tiny")
    model = load_model(path, dtype="bfloat16", kernels="native")
    cfg, length = model.cfg, model.config.canvas_length
    if not bf16.tiles_first(cfg.hidden_size, 3 * length):
        pytest.skip("dense projections on oneDNN here: a row may round one ulp apart")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (9, 20, 3)]
    canvas = torch.randint(0, cfg.vocab_size, (3, length), generator=gen)
    seqs = Sequences(model, 3, 20 + length)
    seqs.run(
        [seqs.row(i, Mode.ENCODE, 0, len(p)) for i, p in enumerate(prompts)], torch.cat(prompts)
    )
    rows = [seqs.row(i, Mode.DECODE, len(p), length) for i, p in enumerate(prompts)]
    together = seqs.run(rows, canvas.flatten()).view(3, length, -1)
    assert together.dtype == torch.bfloat16
    for i in range(3):
        alone = seqs.run([rows[i]], canvas[i]).view(length, -1)
        assert torch.equal(alone, together[i]), i
