"""The launcher calls `loadtest.gpu.compile` compiles: each Triton kernel of Canvas at the real
26B-A4B shapes in bf16 (engine.checkpoints.tiny REAL_26B_A4B_TEXT_CONFIG), its edge specialisations
(one token, one AR row, a page table of width 1, short canvases), the shapes of the gpu tests,
and the fp32 paths (gpu-train's evaluation of SmolLM2, toy engines).

Tensors are CPU `torch.empty` with the engine's layouts: q, k, v contiguous [N, heads, D]
(norm and RoPE outputs), KV pools [pages, kv heads, page, D], contiguous weights. Only the
token count is small (it changes no specialisation unless it is 1). Import after
TRITON_INTERPRET is known to be unset: the launchers choose their block sizes from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from engine.checkpoints.tiny import REAL_26B_A4B_CANVAS_LENGTH, REAL_26B_A4B_TEXT_CONFIG
from kernels.reference import PagedRows


@dataclass(frozen=True, slots=True)
class Variant:
    """One launcher call: every kernel it compiles is checked."""

    name: str
    group: str  # "real" (26B-A4B bf16), "edge", "test" (the gpu tests' shapes), "fp32"
    launch: Callable[[], object]
    # The first architecture that compiles it: FP8 E4M3 kernels need sm_89 (sm_80 engines
    # bind the dequantizing twins instead, `kernels.triton_fp8.e4m3_kernels`).
    min_arch: int = 0

    @property
    def spills_allowed(self) -> bool:
        return self.group == "fp32"


REAL = REAL_26B_A4B_TEXT_CONFIG
CANVAS = REAL_26B_A4B_CANVAS_LENGTH
BF16, FP32 = torch.bfloat16, torch.float32
PAGE = 16  # EngineConfig.page_size
FP8_ARCH = 89  # Triton's FP8 E4M3 (fp8e4nv) starts at sm_89


def _rows(prefixes: list[int], lengths: list[int], decode: list[bool], page: int) -> PagedRows:
    tables, used = [], 0
    for prefix, length in zip(prefixes, lengths, strict=True):
        n = -(-(prefix + length) // page)
        tables.append(list(range(used, used + n)))
        used += n
    return PagedRows.build(prefixes, lengths, decode, tables)


def attention(
    head_dim: int,
    kv_heads: int,
    window: int,
    dtype: torch.dtype,
    heads: int = 16,
    prefixes: tuple[int, ...] = (2048,),
    lengths: tuple[int, ...] = (CANVAS,),
    decode: bool = True,
    page: int = PAGE,
    write: bool = False,
    images: bool = False,
) -> Callable[[], object]:
    """`canvas_attention` (or `write_kv` with `write`) over rows after `prefixes` cached
    positions; DECODE rows, or ENCODE rows (a commit or prefill) when not `decode` — always for
    `write_kv`, which launches nothing for DECODE rows (they write no KV); `images`: with spans
    (image tokens attended both ways: the `HAS_SPAN` specialisation)."""

    def launch() -> object:
        from kernels import triton_attention

        encode = not decode or write
        rows = _rows(list(prefixes), list(lengths), [not encode] * len(lengths), page)
        n, pages = sum(lengths), int(rows.page_table.max()) + 1
        if images:
            rows = replace(rows, span=torch.zeros(n, 2, dtype=torch.int32))
        q = torch.empty(n, heads, head_dim, dtype=dtype)
        k, v = (torch.empty(n, kv_heads, head_dim, dtype=dtype) for _ in range(2))
        pools = [torch.empty(pages, kv_heads, page, head_dim, dtype=dtype) for _ in range(2)]
        if write:
            return triton_attention.write_kv(k, v, *pools, rows)
        return triton_attention.canvas_attention(q, k, v, *pools, rows, window, head_dim**-0.5)

    return launch


def moe(
    num_tokens: int,
    dtype: torch.dtype,
    hidden: int = REAL["hidden_size"],
    experts: int = REAL["num_experts"],
    top_k: int = REAL["top_k_experts"],
    inter: int = REAL["moe_intermediate_size"],
    misaligned: bool = False,
    route: bool = True,
    fp8: bool = False,
) -> Callable[[], object]:
    """The router (`route`) or the experts (`fused_moe`: gate_up with GeGLU, down weighted;
    `fp8_moe` over FP8 weights and their per-channel scales with `fp8`). `misaligned`: hidden
    rows of a wider tensor at a 4-byte offset, as test_moe gives them."""

    def launch() -> object:
        from kernels import triton_moe

        x = torch.empty(num_tokens, hidden, dtype=dtype)  # the engine's: a tensor of its own
        if misaligned:  # (a one-row slice is contiguous already: `contiguous()` would keep it)
            x = torch.empty(num_tokens, hidden + 5, dtype=dtype)[:, 2 : 2 + hidden]
        if route:
            proj = torch.empty(experts, hidden, dtype=dtype)
            scale, pes = torch.empty(hidden, dtype=dtype), torch.empty(experts, dtype=dtype)
            return triton_moe.route_experts(x, scale, proj, pes, top_k, 1e-6)
        w_dtype = torch.float8_e4m3fn if fp8 else dtype
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=w_dtype)
        down = torch.empty(experts, hidden, inter, dtype=w_dtype)
        ids = torch.arange(num_tokens * top_k).view(num_tokens, top_k) % experts
        weights = torch.empty(num_tokens, top_k)
        if fp8:
            gate_up_scale = torch.empty(experts, 2 * inter, 1)
            down_scale = torch.empty(experts, hidden, 1)
            return triton_moe.fp8_moe(x, gate_up, gate_up_scale, down, down_scale, weights, ids)
        return triton_moe.fused_moe(x, gate_up, down, weights, ids)

    return launch


def quantize_rows(num_rows: int, num_cols: int, dtype: torch.dtype) -> Callable[[], object]:
    """`triton_fp8.quantize_fp8_rows`: the activations of an FP8 projection, per token."""

    def launch() -> object:
        from kernels import triton_fp8

        return triton_fp8.quantize_fp8_rows(torch.empty(num_rows, num_cols, dtype=dtype))

    return launch


def fp8_rows(tokens: int, hidden: int, inter: int) -> Callable[[], object]:
    """`triton_fp8_emit`'s kernels over [1, tokens, hidden] rows (the input norm, the pre-norm
    pair) and the dense MLP's [1, tokens, inter] GeGLU product, bf16 in, FP8 rows out."""

    def launch() -> object:
        from kernels import triton_fp8_emit

        x, weight = torch.empty(1, tokens, hidden, dtype=BF16), torch.empty(hidden, dtype=BF16)
        gate = torch.empty(1, tokens, inter, dtype=BF16)
        return (
            triton_fp8_emit.rms_norm_fp8(x, weight, 1e-6),
            triton_fp8_emit.rms_norm_pair_fp8(x, weight, weight, 1e-6),
            triton_fp8_emit.gated_act_fp8(gate, gate, "gelu_pytorch_tanh"),
        )

    return launch


def fp8_experts(
    num_tokens: int,
    hidden: int = REAL["hidden_size"],
    experts: int = REAL["num_experts"],
    top_k: int = REAL["top_k_experts"],
    inter: int = REAL["moe_intermediate_size"],
) -> Callable[[], object]:
    """`triton_fp8_moe.fp8_moe_rows`: FP8 x FP8 experts over FP8 rows, bf16 out."""

    def launch() -> object:
        from kernels import triton_fp8_moe

        fp8 = torch.float8_e4m3fn
        q, q_scale = torch.empty(num_tokens, hidden, dtype=fp8), torch.empty(num_tokens, 1)
        gate_up = torch.empty(experts, 2 * inter, hidden, dtype=fp8)
        down = torch.empty(experts, hidden, inter, dtype=fp8)
        scales = torch.empty(experts, 2 * inter, 1), torch.empty(experts, hidden, 1)
        ids = torch.arange(num_tokens * top_k).view(num_tokens, top_k) % experts
        weights = torch.empty(num_tokens, top_k)
        return triton_fp8_moe.fp8_moe_rows(
            q, q_scale, gate_up, scales[0], down, scales[1], weights, ids, BF16
        )

    return launch


@contextmanager
def _without_gemm() -> Iterator[None]:
    """The soft embedding's GEMM is cuBLAS's (`torch.matmul`), nothing to compile: skipped, so
    that the CPU does not multiply the real [positions, vocab] x [vocab, hidden] here."""
    matmul = torch.matmul
    torch.matmul = lambda a, b, out=None: out  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.matmul = matmul  # type: ignore[assignment]


def sampler(
    vocab: int, hidden: int, dtype: torch.dtype, positions: int = 16, fused: bool = True
) -> Callable[[], object]:
    """`sample_and_embed` (the sampler writing the probabilities, then the GEMM), or, not
    `fused`, `soft_embedding` alone (the probabilities kernel)."""

    def launch() -> object:
        from kernels import triton_sampler

        logits = torch.empty(positions, vocab)
        temp, uniform = torch.empty(positions), torch.empty(positions)
        weight = torch.empty(vocab, hidden, dtype=dtype)
        with _without_gemm():
            if not fused:
                return triton_sampler.soft_embedding(logits, temp, uniform, weight, hidden**0.5)
            return triton_sampler.sample_and_embed(logits, temp, uniform, weight, hidden**0.5)

    return launch


def norm(shape: tuple[int, ...], dtype: torch.dtype, weighted: bool = True) -> Callable[[], object]:
    """`rms_norm` over the last dimension of a contiguous [*shape] (hidden states, heads)."""

    def launch() -> object:
        from kernels import triton_norm

        weight = torch.empty(shape[-1], dtype=dtype) if weighted else None
        return triton_norm.rms_norm(torch.empty(shape, dtype=dtype), weight, 1e-6)

    return launch


def tails(tokens: int, hidden: int, inter: int, dtype: torch.dtype) -> Callable[[], object]:
    """`triton_layer`'s tails over [1, tokens, hidden] rows (the layer scalar per token: mixed
    modes) and the dense MLP's [1, tokens, inter] product, GeGLU in bf16, SwiGLU in fp32."""

    def launch() -> object:
        from kernels import triton_layer

        rows = [torch.empty(1, tokens, hidden, dtype=dtype) for _ in range(3)]
        weight, scale = torch.empty(hidden, dtype=dtype), torch.empty(1, tokens, 1, dtype=dtype)
        gate = torch.empty(1, tokens, inter, dtype=dtype)
        activation = "silu" if dtype == FP32 else "gelu_pytorch_tanh"
        return (
            triton_layer.add_rms_norm(rows[0], rows[1], weight, 1e-6),
            triton_layer.rms_norm_pair(rows[0], weight, weight, 1e-6),
            triton_layer.close_layer(*rows, weight, weight, weight, scale, 1e-6),
            triton_layer.gated_act(gate, gate, activation),
        )

    return launch


def norm_rope(
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    v_is_k: bool = False,
    tokens: int = CANVAS,
) -> Callable[[], object]:
    """`qkv_norm_rope` over the projections' [N, heads, D] views of `tokens` tokens; `v_is_k`:
    a full layer (V is the raw k_proj output)."""

    def launch() -> object:
        from kernels import triton_norm

        q, k = (torch.empty(tokens, h, dim, dtype=dtype) for h in (heads, kv_heads))
        v = k if v_is_k else torch.empty(tokens, kv_heads, dim, dtype=dtype)
        weight, table = torch.empty(dim, dtype=dtype), torch.empty(tokens, dim, dtype=dtype)
        return triton_norm.qkv_norm_rope(q, k, v, weight, weight, table, table, 1e-6)

    return launch


def softcap(positions: int, vocab: int, dtype: torch.dtype) -> Callable[[], object]:
    def launch() -> object:
        from kernels import triton_norm

        return triton_norm.softcap(torch.empty(positions, vocab, dtype=dtype), 30.0)

    return launch


def philox(rows: int, length: int) -> Callable[[], object]:
    """`philox_uniform` of a seed per row [rows, 1] at counters [rows, length]."""

    def launch() -> object:
        from kernels import triton_sampler

        seeds = torch.empty(rows, 1, dtype=torch.int64)
        return triton_sampler.philox_uniform(seeds, torch.empty(rows, length, dtype=torch.int64))

    return launch


def accept(length: int, rows: int = 4) -> Callable[[], object]:
    def launch() -> object:
        from kernels import triton_sampler

        return triton_sampler.entropy_accept(torch.empty(rows, length), torch.empty(rows))

    return launch


def _real() -> list[Variant]:
    d, kv, heads = REAL["head_dim"], REAL["num_key_value_heads"], REAL["num_attention_heads"]
    d_full, kv_full = REAL["global_head_dim"], REAL["num_global_key_value_heads"]
    window = REAL["sliding_window"]
    return [
        Variant("attention sliding D=256", "real", attention(d, kv, window, BF16)),
        Variant("attention full D=512", "real", attention(d_full, kv_full, 0, BF16)),
        Variant("write_kv D=256", "real", attention(d, kv, window, BF16, write=True)),
        Variant("write_kv D=512", "real", attention(d_full, kv_full, 0, BF16, write=True)),
        Variant("router", "real", moe(CANVAS, BF16)),
        Variant("experts", "real", moe(CANVAS, BF16, route=False)),
        Variant("sample_and_embed", "real", sampler(REAL["vocab_size"], REAL["hidden_size"], BF16)),
        Variant(
            "soft_embedding",
            "real",
            sampler(REAL["vocab_size"], REAL["hidden_size"], BF16, fused=False),
        ),
        Variant("entropy_accept L=256", "real", accept(CANVAS)),
        Variant("rms_norm hidden", "real", norm((1, CANVAS, REAL["hidden_size"]), BF16)),
        Variant(
            "layer tails",
            "real",
            tails(CANVAS, REAL["hidden_size"], REAL["intermediate_size"], BF16),
        ),
        Variant("qkv_norm_rope sliding D=256", "real", norm_rope(heads, kv, d, BF16)),
        Variant("softcap", "real", softcap(CANVAS, REAL["vocab_size"], BF16)),
        Variant("philox", "real", philox(16, CANVAS)),
    ]


def _others() -> list[Variant]:
    d, kv = REAL["head_dim"], REAL["num_key_value_heads"]
    d_full, kv_full = REAL["global_head_dim"], REAL["num_global_key_value_heads"]
    window = REAL["sliding_window"]
    ar = {"prefixes": (5,), "lengths": (1,)}  # one AR row: one token, a page table of width 1
    mixed = {"prefixes": (3000, 700, 0), "lengths": (256, 256, 300), "page": 64}
    image = {"prefixes": (0, 300), "lengths": (600, 300), "decode": False, "images": True}
    return [
        Variant("image prefill, sliding", "edge", attention(d, kv, window, BF16, **image)),
        Variant("image prefill, full", "edge", attention(d_full, kv_full, 0, BF16, **image)),
        Variant("AR row, sliding", "edge", attention(d, kv, window, BF16, **ar)),
        Variant("AR row, full", "edge", attention(d_full, kv_full, 0, BF16, **ar)),
        Variant(
            "AR row, write_kv",
            "edge",
            attention(d, kv, window, BF16, decode=False, write=True, **ar),
        ),
        # The full layers' norms and RoPE (V is k): the sliding variant's kernel, other blocks.
        Variant("qkv_norm_rope full D=512", "edge", norm_rope(16, kv_full, d_full, BF16, True)),
        Variant("one-token router", "edge", moe(1, BF16)),
        Variant("one-token experts", "edge", moe(1, BF16, route=False)),
        Variant("entropy_accept L=1", "edge", accept(1)),
        Variant("entropy_accept L=37", "edge", accept(37)),
        Variant("one-token rms_norm", "edge", norm((1, 1, REAL["hidden_size"]), BF16)),
        Variant(
            "one-token layer tails",
            "edge",
            tails(1, REAL["hidden_size"], REAL["intermediate_size"], BF16),
        ),
        Variant("one-position philox", "edge", philox(1, 1)),
        Variant("test_attention sliding", "test", attention(d, kv, window, BF16, **mixed)),
        Variant("test_attention full", "test", attention(d_full, kv_full, 0, BF16, **mixed)),
        Variant("test_moe router", "test", moe(4096, BF16, misaligned=True)),
        Variant("test_moe experts", "test", moe(4096, BF16, misaligned=True, route=False)),
        # gpu-train's evaluation: SmolLM2-135M (9 heads, 3 KV heads of 64, vocab 49,152).
        Variant("SmolLM2 attention fp32", "fp32", attention(64, 3, 0, FP32, heads=9)),
        Variant("SmolLM2 sample_and_embed fp32", "fp32", sampler(49_152, 576, FP32)),
        Variant("SmolLM2 rms_norm fp32", "fp32", norm((1, 64, 576), FP32)),
        Variant("SmolLM2 layer tails fp32", "fp32", tails(64, 576, 1536, FP32)),
        Variant("qkv_norm_rope heads D=64 fp32", "fp32", norm_rope(9, 3, 64, FP32)),
        Variant("toy softcap fp32", "fp32", softcap(64, 1000, FP32)),
        Variant("toy experts fp32", "fp32", moe(64, FP32, 64, 8, 2, 32, route=False)),
    ]


def _fp8_real() -> list[Variant]:
    hidden, inter = REAL["hidden_size"], REAL["intermediate_size"]
    return [
        Variant("FP8 experts", "real", moe(CANVAS, BF16, route=False, fp8=True), FP8_ARCH),
        Variant("FP8 quantize rows hidden", "real", quantize_rows(CANVAS, hidden, BF16), FP8_ARCH),
        Variant("FP8 quantize rows MLP", "real", quantize_rows(CANVAS, inter, BF16), FP8_ARCH),
        Variant("FP8 rows norms and GeGLU", "real", fp8_rows(CANVAS, hidden, inter), FP8_ARCH),
        Variant("FP8 x FP8 experts", "real", fp8_experts(CANVAS), FP8_ARCH),
    ]


def _fp8_edge() -> list[Variant]:
    return [
        Variant("one-token FP8 experts", "edge", moe(1, BF16, route=False, fp8=True), FP8_ARCH),
        Variant(
            "one-token FP8 quantize rows",
            "edge",
            quantize_rows(1, REAL["hidden_size"], BF16),
            FP8_ARCH,
        ),
        Variant(
            "one-token FP8 rows norms and GeGLU",
            "edge",
            fp8_rows(1, REAL["hidden_size"], REAL["intermediate_size"]),
            FP8_ARCH,
        ),
        Variant("one-token FP8 x FP8 experts", "edge", fp8_experts(1), FP8_ARCH),
    ]


SETS = {
    "make-test": lambda: _real() + _fp8_real(),
    "all": lambda: _real() + _fp8_real() + _others() + _fp8_edge(),
    "fp8": lambda: _fp8_real() + _fp8_edge(),
}


def variants(which: str) -> list[Variant]:
    return SETS[which]()
