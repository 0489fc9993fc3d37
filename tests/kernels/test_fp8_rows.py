"""FP8 rows (sm_90's FP8 path): the norms and the GeGLU product emit FP8 with per-token scales
that the projections and the experts take without a quantizer. The Triton kernels run under
the interpreter (it stores float8_e4m3fn on the CPU): the fused norms are bit for bit the bf16
kernel followed by the quantizer, and within one E4M3 step of their twins; the FP8 x FP8
experts match their twin; a tiny FP8 model bound with the FP8-rows twins runs without one
quantizer launch but attention's output projection, close to the model that quantizes in each
projection."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from engine.model import Mode, layers, load_model
from engine.model.adapter import AdapterConfig, attach_adapter
from kernels import reference, resolve_kernels, triton_available, triton_ops
from kernels.kernel_set import FP8_ROWS
from kernels.reference_fp8 import quantize_fp8_groups
from tests.e2e.forward_cases import Sequences

FP8 = torch.float8_e4m3fn
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")


def quantized(*shape: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight [..., out, in] and its per-channel scale [..., out, 1]."""
    weight = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5
    scale = weight.abs().amax(-1, keepdim=True) / 448
    return (weight / scale).to(FP8), scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def assert_within_one_e4m3_step(got: tuple, want: tuple) -> None:
    """Dequantized rows that differ by at most one E4M3 step (2^-3 of a normal value; 2^-9 of
    the row's scale for subnormals): the scales may differ by the last bit of the input dtype
    (fp32 reduction order), which moves a value across a rounding boundary at most."""
    a, b = dequantized(*got), dequantized(*want)
    step = torch.maximum(a.abs(), b.abs()) / 8 + got[1] * 2**-9 * 448 / 64
    assert ((a - b).abs() <= step).all()


def rows_case(dtype: torch.dtype, num_rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, num_rows, dim + 3, generator=gen)[..., 3:]  # rows at a stride
    return x.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "dim"), [(1, 16), (7, 40), (3, 300)])
def test_triton_fp8_norms_are_the_bf16_kernel_then_the_quantizer(
    dtype: torch.dtype, num_rows: int, dim: int, device: torch.device
) -> None:
    from kernels import triton_fp8, triton_fp8_emit, triton_layer, triton_norm

    x = rows_case(dtype, num_rows, dim).to(device)
    gen = torch.Generator().manual_seed(1)
    w_a, w_b = (torch.randn(dim, generator=gen).to(dtype).to(device) for _ in range(2))

    def quantized_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = triton_fp8.quantize_fp8_rows(t.reshape(-1, dim))
        return q.view(torch.uint8).reshape(t.shape), scale.reshape(*t.shape[:-1], 1)

    def as_bits(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert q.dtype == FP8 and scale.dtype == torch.float32 and q.shape == x.shape
        return q.view(torch.uint8), scale

    for weight in (w_a, None):
        got = as_bits(*triton_fp8_emit.rms_norm_fp8(x, weight, 1e-6))
        want = quantized_rows(triton_norm.rms_norm(x, weight, 1e-6))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        twin = reference.rms_norm_fp8(x, weight, 1e-6)
        assert_within_one_e4m3_step(triton_fp8_emit.rms_norm_fp8(x, weight, 1e-6), twin)
    qa, sa, qb, sb = triton_fp8_emit.rms_norm_pair_fp8(x, w_a, w_b, 1e-6)
    want_a, want_b = triton_layer.rms_norm_pair(x.contiguous(), w_a, w_b, 1e-6)
    for got, want in (((qa, sa), want_a), ((qb, sb), want_b)):
        assert all(map(torch.equal, as_bits(*got), quantized_rows(want)))
    twin = reference.rms_norm_pair_fp8(x, w_a, w_b, 1e-6)
    assert_within_one_e4m3_step((qa, sa), twin[:2])
    assert_within_one_e4m3_step((qb, sb), twin[2:])


@needs_triton
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "silu"])
@pytest.mark.parametrize(("num_rows", "dim"), [(1, 16), (9, 72)])
def test_triton_gated_act_fp8_is_the_bf16_kernel_then_the_quantizer(
    activation: str, num_rows: int, dim: int, device: torch.device
) -> None:
    from kernels import triton_fp8, triton_fp8_emit, triton_layer

    gen = torch.Generator().manual_seed(num_rows)
    gate, up = (torch.randn(1, num_rows, dim, generator=gen).bfloat16().to(device) for _ in "gu")
    up[0, 0] = 0  # a zero row of the product: the scale's floor
    q, scale = triton_fp8_emit.gated_act_fp8(gate, up, activation)
    want = triton_fp8.quantize_fp8_rows(triton_layer.gated_act(gate, up, activation)[0])
    assert q.shape == gate.shape and scale.shape == (1, num_rows, 1)
    assert torch.equal(q[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scale[0], want[1]) and not q[0, 0].float().any()
    assert_within_one_e4m3_step((q, scale), reference.gated_act_fp8(gate, up, activation))


def test_the_fp8_rows_twins_quantize_the_unquantized_kernels_output() -> None:
    """Per token: scale = amax / 448 of the norm's output, values within FP8's rounding."""
    x = rows_case(torch.float32, 5, 64)
    weight = torch.randn(64, generator=torch.Generator().manual_seed(2))
    q, scale = reference.rms_norm_fp8(x, weight, 1e-6)
    normed = reference.rms_norm_fused(x, weight, 1e-6)
    assert q.dtype == FP8 and scale.shape == (1, 5, 1)
    torch.testing.assert_close(scale, normed.abs().amax(-1, keepdim=True) / 448)
    assert ((dequantized(q, scale) - normed).abs() <= normed.abs() / 16 + scale).all()
    gate, up = rows_case(torch.float32, 5, 64, 3), rows_case(torch.float32, 5, 64, 4)
    q, scale = reference.gated_act_fp8(gate, up, "silu")
    product = reference.gated_act(gate, up, "silu")
    torch.testing.assert_close(scale, product.abs().amax(-1, keepdim=True) / 448)


def test_quantize_fp8_groups_scales_each_block_of_a_row_apart() -> None:
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(5))
    x[1, 128:256] *= 1000  # one block far larger: the others keep their own scale
    q, scale = quantize_fp8_groups(x, 128)
    assert q.shape == x.shape and scale.shape == (3, 3)
    for block, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 300))):
        want_q, want_scale = reference.quantize_fp8_rows(x[:, cols])
        assert torch.equal(q[:, cols].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scale[:, block : block + 1], want_scale)


@needs_triton
def test_triton_fp8_linear_rows_takes_the_rows_scales_as_they_are(device: torch.device) -> None:
    """`_scaled_mm` on the emitted rows: the fp32 product of both dequantized operands, one
    rounding to bf16 (the twin), and `fp8_linear` is the quantizer then this."""
    from kernels import triton_fp8

    gen = torch.Generator().manual_seed(3)
    weight, scale = (t.to(device) for t in quantized(32, 48, gen=gen))
    x = torch.randn(1, 5, 48, generator=gen).bfloat16().to(device)
    q, q_scale = reference.quantize_fp8_rows(x)
    got = triton_fp8.fp8_linear_rows(q, q_scale, weight, scale, torch.bfloat16)
    want = reference.fp8_linear_rows(q, q_scale, weight, scale, torch.bfloat16)
    assert got.shape == (1, 5, 32) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert torch.equal(triton_fp8.fp8_linear(x, weight, scale, [5]), got)
    # fp32 out is outside `_scaled_mm`'s contract here: the twin's values exactly
    fp32 = triton_fp8.fp8_linear_rows(q, q_scale, weight, scale, torch.float32)
    assert torch.equal(fp32, reference.fp8_linear_rows(q, q_scale, weight, scale, torch.float32))


def moe_rows_case(
    num_tokens: int, top_k: int, inter: int, device: torch.device, num_experts: int = 6
) -> tuple[torch.Tensor, ...]:
    """FP8 rows [N, 32] with their scales, FP8 experts (I = `inter`) with theirs, routing."""
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    hidden = 32
    gate_up, gate_up_scale = quantized(num_experts, 2 * inter, hidden, gen=gen)
    down, down_scale = quantized(num_experts, hidden, inter, gen=gen)
    q, q_scale = reference.quantize_fp8_rows(torch.randn(num_tokens, hidden, generator=gen))
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    case = (q, q_scale, gate_up, gate_up_scale, down, down_scale, weights, ids)
    return tuple(t.to(device) for t in case)


@needs_triton
@pytest.mark.parametrize(
    ("num_tokens", "top_k", "inter", "dtype"),
    [(1, 1, 24, torch.float32), (9, 3, 200, torch.float32), (13, 2, 136, torch.float16),
     (37, 2, 24, torch.float16)],
)  # fmt: skip
def test_triton_fp8_x_fp8_experts_match_the_twin(
    num_tokens: int, top_k: int, inter: int, dtype: torch.dtype, device: torch.device
) -> None:
    """Odd token counts, an intermediate size over one block of `ACT_GROUP` (200: two blocks,
    the last short), half precision as fp16 under the interpreter (its bf16 dots are not
    bf16's). The tolerances allow a GeGLU element one E4M3 step (2^-4 relative) off the twin's
    where the fp32 sum order moves it across a rounding boundary."""
    from kernels import triton_fp8_moe

    if device.type == "cuda" and dtype == torch.float16:
        dtype = torch.bfloat16
    case = moe_rows_case(num_tokens, top_k, inter, device)
    got = triton_fp8_moe.fp8_moe_rows(*case, dtype, segments=[num_tokens])
    want = reference.fp8_moe_rows(*case, dtype)
    assert got.dtype == dtype and got.shape == (num_tokens, 32)
    tol = 2e-2 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # against the bf16 x FP8 experts on the dequantized rows: FP8's rounding of the GeGLU
    # output, nothing more
    q, q_scale, *weights = case
    dense = reference.fp8_moe(dequantized(q, q_scale), *weights).float()
    assert (got.float() - dense).abs().max() <= 0.1 * dense.abs().max()


@needs_triton
def test_triton_fp8_x_fp8_experts_apply_each_scale_where_it_belongs(device: torch.device) -> None:
    """A token's scale scales its output alone; an output channel's scale its column alone."""
    from kernels import triton_fp8_moe

    q, q_scale, *experts = moe_rows_case(5, 2, 24, device, num_experts=3)
    base = triton_fp8_moe.fp8_moe_rows(q, q_scale, *experts, torch.float32)
    doubled = q_scale.clone()
    doubled[3] *= 2  # gelu is not linear: token 3 changes, the others not at all
    other = triton_fp8_moe.fp8_moe_rows(q, doubled, *experts, torch.float32)
    assert not torch.equal(other[3], base[3])
    assert torch.equal(other[[0, 1, 2, 4]], base[[0, 1, 2, 4]])
    gate_up, gate_up_scale, down, down_scale, weights, ids = experts
    down_scale = down_scale.clone()
    down_scale[:, 7] *= 2
    twice = triton_fp8_moe.fp8_moe_rows(
        q, q_scale, gate_up, gate_up_scale, down, down_scale, weights, ids, torch.float32
    )
    torch.testing.assert_close(twice[:, 7], 2 * base[:, 7])
    others = [c for c in range(32) if c != 7]
    assert torch.equal(twice[:, others], base[:, others])


@needs_triton
@pytest.mark.parametrize(
    ("capability", "version", "bound"),
    [((9, 0), "2.13.0", True), ((8, 9), "2.13.0", False), ((8, 0), "2.13.0", False),
     ((9, 0), "2.4.1", False)],
)  # fmt: skip
def test_triton_binds_the_fp8_rows_kernels_with_scaled_mm_only(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], version: str, bound: bool
) -> None:
    from kernels import triton_fp8, triton_fp8_emit, triton_fp8_moe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch, "__version__", version)
    ks = resolve_kernels("cuda", "triton")
    assert ks.fp8_rows == bound
    if bound:
        assert ks.rms_norm_pair_fp8 is triton_fp8_emit.rms_norm_pair_fp8
        assert ks.fp8_linear_rows is triton_fp8.fp8_linear_rows
        assert ks.fp8_moe_rows is triton_fp8_moe.fp8_moe_rows
    else:
        assert all(getattr(ks, name) is None for name in FP8_ROWS)
    assert not resolve_kernels("cpu", "twins").fp8_rows  # the CPU engines: unchanged


def test_the_custom_op_set_runs_the_fp8_rows_kernels_on_meta_and_as_twins() -> None:
    ks = resolve_kernels("cpu", "twins").with_fp8_rows().with_custom_ops()
    assert ks.rms_norm_fp8 is not reference.rms_norm_fp8 and ks.fp8_rows
    assert not resolve_kernels("cpu", "twins").with_custom_ops().fp8_rows
    case = moe_rows_case(7, 2, 24, torch.device("cpu"))
    assert torch.equal(
        ks.fp8_moe_rows(*case, torch.float32), reference.fp8_moe_rows(*case, torch.float32)
    )
    with torch.device("meta"):
        x, w = torch.empty(1, 5, 32, dtype=torch.bfloat16), torch.empty(32, dtype=torch.bfloat16)
        qa, sa, qb, sb = ks.rms_norm_pair_fp8(x, w, w, 1e-6)
        q, s = ks.gated_act_fp8(x, x, "gelu_pytorch_tanh")
        y = ks.fp8_linear_rows(q, s, torch.empty(24, 32, dtype=FP8), torch.empty(24, 1), x.dtype)
        meta_case = [torch.empty_like(t, device="meta") for t in case]
        out = ks.fp8_moe_rows(*meta_case, torch.bfloat16, segments=[7])
    assert (qa.dtype, sa.shape, qb.shape, q.dtype) == (FP8, (1, 5, 1), (1, 5, 32), FP8)
    assert (y.shape, y.dtype, out.shape, out.dtype) == ((1, 5, 24), x.dtype, (7, 32), x.dtype)


def counted(kernels, calls: Counter):
    """`kernels` with every FP8 kernel (and the quantizer behind `fp8_linear`) counted."""

    def wrap(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    names = ("fp8_linear", "fp8_moe", "rms_norm", "rms_norm_pair", "gated_act", *FP8_ROWS)
    return replace(
        kernels, **{n: wrap(n, getattr(kernels, n)) for n in names if getattr(kernels, n)}
    )


def first_step_logits(model) -> torch.Tensor:
    """Logits of a first denoising step over a random canvas after a 12-token prompt."""
    length, vocab = model.config.canvas_length, model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt, canvas = (
        torch.randint(0, vocab, (12,), generator=gen),
        torch.randint(0, vocab, (length,), generator=gen),
    )
    seqs = Sequences(model, 1, 12 + length)
    seqs.run([seqs.row(0, Mode.ENCODE, 0, 12)], prompt)
    return model.logits(seqs.run([seqs.row(0, Mode.DECODE, 12, length)], canvas)).float()


def quantizing(kernels):
    """`kernels` as sm_90 runs FP8 weights without FP8 rows: each projection and the experts
    quantize their own input per token (`triton_fp8.fp8_linear`), then take it as FP8 rows."""

    def fp8_linear(x, weight, scale, segments):
        return reference.fp8_linear_rows(*reference.quantize_fp8_rows(x), weight, scale, x.dtype)

    def fp8_moe(hidden, gate_up, gate_up_scale, down, down_scale, weights, ids, segments=None):
        rows = reference.quantize_fp8_rows(hidden)
        experts = (gate_up, gate_up_scale, down, down_scale, weights, ids)
        return reference.fp8_moe_rows(*rows, *experts, hidden.dtype)

    return replace(kernels, fp8_linear=fp8_linear, fp8_moe=fp8_moe)


def test_a_model_on_fp8_rows_quantizes_once_per_input_and_gives_the_same_logits(tiny_checkpoint):
    """c16 with FP8 weights, the twins: bound with the FP8-rows kernels, every projection but
    o_proj takes the rows the kernel before it emitted (q/k/v share one, gate/up one, the
    experts one), and the logits are bit for bit those of each projection quantizing its own
    input: the rows are the same, computed once."""
    model = load_model(tiny_checkpoint("c16"), dtype="float32", kernels="twins", quantization="fp8")
    plain_calls, rows_calls = Counter(), Counter()
    model.bind_kernels(counted(quantizing(resolve_kernels("cpu", "twins")), plain_calls))
    plain = first_step_logits(model)
    rows_set = quantizing(resolve_kernels("cpu", "twins").with_fp8_rows())  # sm_90's o_proj
    model.bind_kernels(counted(rows_set, rows_calls))
    rows = first_step_logits(model)
    layers = 2 * model.cfg.num_layers  # two forwards: the prompt, then the canvas
    assert rows_calls["fp8_linear"] == layers  # o_proj, each layer
    # the input norms, and the canvas forward's self-conditioning block (its pre-norm, GeGLU)
    assert rows_calls["rms_norm_fp8"] == rows_calls["gated_act_fp8"] == layers + 1
    assert rows_calls["rms_norm_pair_fp8"] == rows_calls["fp8_moe_rows"] == layers
    assert rows_calls["fp8_linear_rows"] == plain_calls["fp8_linear"] - layers
    assert rows_calls["fp8_moe"] == rows_calls["rms_norm_pair"] == rows_calls["gated_act"] == 0
    assert torch.equal(rows, plain)


def test_the_fp8_rows_path_is_decided_when_kernels_are_bound(tiny_checkpoint, monkeypatch):
    """Which norms emit FP8 rows and which projections take them is chosen by `bind_kernels`
    (each binding chooses again; an adapter's LoRA deltas, attached with a binding, turn the
    layers' off), never in a forward: with the choice unaskable after binding, the forward takes
    the rows path and gives the logits of each projection quantizing its own input."""
    model = load_model(tiny_checkpoint("c16"), dtype="float32", kernels="twins", quantization="fp8")
    model.bind_kernels(quantizing(resolve_kernels("cpu", "twins")))
    plain = first_step_logits(model)
    asked = Counter()
    choose = layers.takes_fp8_rows
    monkeypatch.setattr(layers, "takes_fp8_rows", lambda *a: asked.update(["x"]) or choose(*a))
    calls: Counter = Counter()
    model.bind_kernels(counted(quantizing(resolve_kernels("cpu", "twins").with_fp8_rows()), calls))
    # per layer: q/k/v, gate/up, down; and the self-conditioning block's gate/up and down
    assert asked["x"] == 3 * model.cfg.num_layers + 2
    assert all(layer.pre_feedforward_fp8 and layer.self_attn.fp8_rows for layer in model.layers)

    def refused(*args):
        raise AssertionError("the FP8 rows path was chosen during a forward")

    monkeypatch.setattr(layers, "takes_fp8_rows", refused)
    rows = first_step_logits(model)
    assert calls["rms_norm_pair_fp8"] == calls["fp8_moe_rows"] == 2 * model.cfg.num_layers
    assert calls["rms_norm_pair"] == 0 and torch.equal(rows, plain)
    monkeypatch.setattr(layers, "takes_fp8_rows", choose)
    attach_adapter(model, AdapterConfig(model.config.canvas_length, rank=4))
    assert not any(layer.self_attn.fp8_rows or layer.mlp.fp8_rows for layer in model.layers)
    assert not any(layer.pre_feedforward_fp8 for layer in model.layers)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama converted to the block-diffusion layout (`canvas convert`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.adapt.convert import ConvertOptions, convert
    from engine.checkpoints.tiny import build_tokenizer

    config = LlamaConfig(
        vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    source = tmp_path_factory.mktemp("llama-src")
    LlamaForCausalLM(config).save_pretrained(source)
    build_tokenizer(512).save_pretrained(source)
    out = tmp_path_factory.mktemp("llama-canvas")
    return convert(str(source), out, ConvertOptions(canvas_length=8))


def test_a_llama_backbone_on_fp8_rows_gives_the_same_logits(llama_checkpoint):
    """The Llama backbone (the default model's) passes its norms' FP8 rows through too: the
    input norm's to q/k/v, the post-attention norm's to gate/up."""
    model = load_model(llama_checkpoint, dtype="float32", kernels="twins", quantization="fp8")
    model.bind_kernels(quantizing(resolve_kernels("cpu", "twins")))
    plain = first_step_logits(model)
    calls: Counter = Counter()
    model.bind_kernels(counted(quantizing(resolve_kernels("cpu", "twins").with_fp8_rows()), calls))
    rows = first_step_logits(model)
    layers = 2 * model.cfg.num_layers  # two forwards
    assert calls["rms_norm_fp8"] == 2 * layers + 1  # and the self-conditioning block's
    assert calls["gated_act_fp8"] == layers + 1 and calls["fp8_linear"] == layers  # o_proj
    assert calls["rms_norm"] == 2  # the final norm of each forward
    assert torch.equal(rows, plain)


@needs_triton
def test_the_triton_fp8_rows_kernels_give_the_twins_logits(tiny_checkpoint, device):
    """The same model through Triton's FP8-rows kernels (the interpreter; `_scaled_mm` is
    torch's CPU one): the twins' logits within FP8's rounding."""
    if device.type != "cpu":
        pytest.skip("the model runs on the CPU: Triton's kernels there under the interpreter")
    path = tiny_checkpoint("c16")
    model = load_model(path, dtype="float32", kernels="twins", quantization="fp8")
    model.bind_kernels(resolve_kernels("cpu", "twins").with_fp8_rows())
    twins = first_step_logits(model)
    model.bind_kernels(resolve_kernels("cpu", "twins").with_fp8_rows(triton_ops()))
    triton = first_step_logits(model)
    assert (triton - twins).norm() <= 0.02 * twins.norm()


def test_the_fp8_rows_kernels_are_in_the_sm90_compile_check_from_sm89() -> None:
    from loadtest.gpu.compile_variants import FP8_ARCH, variants

    new = {"FP8 rows norms and GeGLU", "FP8 x FP8 experts"}
    for which in ("make-test", "fp8"):
        chosen = {v.name: v for v in variants(which) if v.name in new}
        assert chosen.keys() == new and {v.min_arch for v in chosen.values()} == {FP8_ARCH}
    edge = {v.name for v in variants("all") if v.group == "edge"}
    assert {"one-token FP8 rows norms and GeGLU", "one-token FP8 x FP8 experts"} <= edge


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not (triton_available() and hopper()), reason="needs an sm_90 GPU")
def test_fp8_rows_at_the_real_shapes_on_sm90() -> None:
    """The first GPU run's check of sm_90's FP8 path at 26B-A4B's shapes (a canvas of 256
    tokens, bf16): the Triton backend binds the FP8 rows; the fused norms and GeGLU product are
    bit for bit the bf16 kernels then the quantizer; `_scaled_mm` on the rows is `fp8_linear`;
    the FP8 x FP8 experts (128 experts, top 8) match their twin."""
    from engine.checkpoints.tiny import REAL_26B_A4B_TEXT_CONFIG as real
    from kernels import triton_fp8, triton_layer, triton_norm

    cuda = torch.device("cuda")
    ks = resolve_kernels("cuda", "triton")
    assert ks.fp8_rows
    hidden, inter = real["hidden_size"], real["intermediate_size"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 256, hidden, generator=gen).bfloat16().to(cuda)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16().to(cuda)
    q, scale = ks.rms_norm_fp8(x, w, 1e-6)
    want = triton_fp8.quantize_fp8_rows(triton_norm.rms_norm(x, w, 1e-6)[0])
    assert torch.equal(q[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(scale[0], want[1])
    gate, up = (torch.randn(1, 256, inter, generator=gen).bfloat16().to(cuda) for _ in "gu")
    q_act, s_act = ks.gated_act_fp8(gate, up, "gelu_pytorch_tanh")
    want = triton_fp8.quantize_fp8_rows(triton_layer.gated_act(gate, up, "gelu_pytorch_tanh")[0])
    assert torch.equal(q_act[0].view(torch.uint8), want[0].view(torch.uint8))
    weight, w_scale = (t.to(cuda) for t in quantized(4096, hidden, gen=gen))
    normed = triton_norm.rms_norm(x, w, 1e-6)
    rows = ks.fp8_linear_rows(q, scale, weight, w_scale, torch.bfloat16)
    assert torch.equal(rows, ks.fp8_linear(normed, weight, w_scale, [256]))
    experts, top_k, moe_inter = (
        real["num_experts"],
        real["top_k_experts"],
        real["moe_intermediate_size"],
    )
    gate_up, gate_up_scale = quantized(experts, 2 * moe_inter, hidden, gen=gen)
    down, down_scale = quantized(experts, hidden, moe_inter, gen=gen)
    logits = torch.randn(256, experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    case = [t.to(cuda) for t in (gate_up, gate_up_scale, down, down_scale, weights, ids)]
    got = ks.fp8_moe_rows(q[0], scale[0], *case, torch.bfloat16)
    twin = reference.fp8_moe_rows(q[0], scale[0], *case, torch.bfloat16)
    torch.testing.assert_close(got, twin, rtol=5e-2, atol=5e-2 * twin.abs().max().item())
