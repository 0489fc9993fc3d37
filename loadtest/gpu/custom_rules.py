"""The accountant's rules for the custom ops (`canvas::*`): what each Triton kernel that CUDA
runs for it costs, in FLOPs, bytes and launches, from its arguments' shapes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from kernels.reference import ALIGN_CHUNK, align_capacity
from kernels.reference_sampler import PROBS_CHUNK_BYTES

if TYPE_CHECKING:
    from loadtest.gpu.accountant import Accountant


def nbytes(tensors: list[Any]) -> int:
    """The bytes of the tensors among `tensors`."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def tensors_of(*trees: Any) -> list[torch.Tensor]:
    """The tensors in nested arguments (tuples, lists, dicts)."""
    return [t for tree in trees for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    cost: dict[str, Any]


Rule = Callable[["Accountant", tuple[Any, ...], Any], list[Part]]


def _attention(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    q, k = args[0], args[1]
    window = args[-2]  # the op's arguments end with (window, scale)
    num_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    rows = acct.rows.rows or [(0, num_tokens, True)]
    flops = kv_bytes = 0.0
    for start, new, decode in rows:
        prefix = min(start, window - 1) if window else start
        keys = prefix + (new if decode else (new + 1) / 2)  # causal: half the block on average
        flops += 4 * heads * dim * new * keys
        kv_bytes += 2 * (prefix + new) * kv_heads * dim * k.element_size()
    io = 2 * q.numel() * q.element_size() + kv_bytes
    cost = {"flops": flops, "bytes": io, "gemm": True, "attention": True}
    return [Part("canvas_attention", cost)]


def _write_kv(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    k, v = args[0], args[1]
    rows = acct.rows.rows or [(0, k.shape[0], False)]
    share = sum(n for _, n, d in rows if not d) / max(sum(n for _, n, _ in rows), 1)
    # No launch when every row is a DECODE row (a denoise step writes no KV).
    return [Part("write_kv", {"bytes": 2 * share * nbytes([k, v]), "launches": int(share > 0)})]


def _route(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    hidden, proj = args[0], args[2]
    flops = 2 * hidden.shape[0] * hidden.shape[1] * proj.shape[0]
    io = nbytes([hidden, proj, *out])
    return [Part("route_experts", {"flops": flops, "bytes": io, "gemm": True})]


def touched_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts that `num_tokens` tokens route to (top_k each, uniform)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


def _moe(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    """Triton's fused_moe (kernels/triton_moe.py): align the pairs, a GEGLU grouped GEMM, a
    weighted down GEMM writing each row of a [N*K, H] buffer (the hidden dtype) once, the slot
    sum and the cast in one pass."""
    hidden, gate_up, down, weights, ids = args
    return _experts("fused_moe", hidden, gate_up, down, ids, ())


def _fp8_moe(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    """Triton's fp8_moe: fused_moe's launches over FP8 weights (one byte an element, cast in
    registers) and their per-channel fp32 scales; activations in the hidden dtype."""
    hidden, gate_up, gate_up_scale, down, down_scale, weights, ids = args
    return _experts("fp8_moe", hidden, gate_up, down, ids, (gate_up_scale, down_scale))


def _fp8_moe_rows(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    """`triton_fp8_moe.fp8_moe_rows`: fused_moe's launches, FP8 x FP8 at FP8's dense peak
    (twice bf16's: FLOPs counted at half, as `_fp8_linear`); FP8 rows read per pair, the
    GeGLU output written and read as FP8 with a scale per row and block, pair rows and the
    output in the activations' dtype."""
    q, q_scale, gate_up, gate_up_scale, down, down_scale, weights, ids, dtype = args
    out_size = torch.empty((), dtype=dtype).element_size()
    scales = (gate_up_scale, down_scale)
    return _experts("fp8_moe_rows", q, gate_up, down, ids, scales, out_size, flops_share=0.5)


def _experts(
    name: str,
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    scales: tuple[torch.Tensor, ...],
    out_size: int | None = None,
    flops_share: float = 1.0,
) -> list[Part]:
    """`out_size`: bytes an element of the pair rows and the output (default: hidden's);
    `flops_share`: the GEMMs' FLOPs counted in bf16 equivalents (0.5: FP8 x FP8)."""
    num_tokens, hid = hidden.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, top_k = two_inter // 2, ids.shape[1]
    pairs, el = num_tokens * top_k, hidden.element_size()
    out_el = out_size or el
    experts = touched_experts(num_tokens, num_experts, top_k)
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    per_expert += sum(s[0].numel() * s.element_size() for s in scales)
    w_bytes = experts * per_expert
    gemm = {
        "flops": flops_share * (2 * pairs * hid * two_inter + 2 * pairs * inter * hid),
        "bytes": w_bytes + pairs * hid * el + 2 * pairs * inter * el + pairs * hid * out_el,
        "launches": 2,
        "gemm": True,
    }
    parts = [Part(f"{name}.align_pairs", cost) for cost in align_pairs_costs(ids, num_experts)]
    pair_rows = pairs * hid * out_el
    return [
        *parts,
        Part(f"{name}.expert_gemms", gemm),
        Part(f"{name}.slot_sum_cast", {"bytes": pair_rows + num_tokens * hid * out_el}),
    ]


def _fp8_linear(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    """`triton_fp8.fp8_linear`: the activations quantized per token (read once for the amax,
    once for the cast; FP8 and the fp32 scales written), then `_scaled_mm` reading the FP8
    rows, the FP8 weight and both scales, writing the output. Its FLOPs are counted in bf16
    equivalents, half the products' count: the accountant costs GEMM FLOPs at the bf16
    tensor-core peak, and FP8's dense peak is twice that on Hopper (so the step's floor, too,
    takes these GEMMs at FP8's peak)."""
    x, weight, scale = args
    rows, (out_dim, in_dim) = x.numel() // x.shape[-1], weight.shape
    quantize = {"bytes": 2 * nbytes([x]) + rows * in_dim + 4 * rows}
    gemm = {
        "flops": rows * in_dim * out_dim,  # 2 * M * K * N products at twice bf16's rate
        "bytes": rows * in_dim + 4 * rows + nbytes([weight, scale, out]),
        "gemm": True,
    }
    return [Part("fp8_linear.quantize_rows", quantize), Part("fp8_linear.scaled_mm", gemm)]


def _fp8_linear_rows(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    """`triton_fp8.fp8_linear_rows`: `_scaled_mm` alone on FP8 rows a kernel before it emitted
    (`_fp8_linear` without the quantizer)."""
    q, q_scale, weight, scale, dtype = args
    rows, (out_dim, in_dim) = q.numel() // q.shape[-1], weight.shape
    gemm = {
        "flops": rows * in_dim * out_dim,  # 2 * M * K * N products at twice bf16's rate
        "bytes": nbytes([q, q_scale, weight, scale, out]),
        "gemm": True,
    }
    return [Part("fp8_linear_rows.scaled_mm", gemm)]


def align_pairs_costs(ids: torch.Tensor, num_experts: int) -> list[dict[str, Any]]:
    """`triton_moe.align_pairs`: three launches and no sync (per-chunk expert counts, one
    program's prefix sums, the placement with the block map and padding rows); it reads the
    ids twice and the [chunks, E] counts three times, and writes the rows and the block map."""
    num_pairs, block_m = ids.numel(), 64
    capacity = align_capacity(num_pairs, num_experts, block_m)
    counts = math.ceil(num_pairs / ALIGN_CHUNK) * max(16, 1 << (num_experts - 1).bit_length())
    io = (
        2 * num_pairs * ids.element_size() + 3 * counts * 4 + capacity * 4 + capacity // block_m * 4
    )
    return [{"bytes": io, "launches": 3}]


def _sample_cost(logits: torch.Tensor, probs_size: int = 0) -> dict[str, Any]:
    # `_sample_kernel`: one program per position, two passes over the vocabulary; with
    # `probs_size` (bytes per probability), the second pass writes the soft embedding's.
    return {"bytes": logits.numel() * (2 * logits.element_size() + probs_size)}


def _probs_chunks(logits: torch.Tensor, weight: torch.Tensor) -> int:
    positions, vocab = logits.shape
    per_chunk = max(1, PROBS_CHUNK_BYTES // max(1, vocab * weight.element_size()))
    return max(1, math.ceil(positions / per_chunk))


def _soft_cost(logits: torch.Tensor, weight: torch.Tensor) -> list[Part]:
    """The soft embedding's GEMM of `triton_sampler`: probabilities [P, V] in weight's dtype
    (written by the sampler or `_probs_kernel`) times the embedding matrix, a chunk of
    positions at a time (cuBLAS: the matrix read once per chunk), then the scale."""
    positions, vocab = logits.shape
    hidden, chunks = weight.shape[1], _probs_chunks(logits, weight)
    el = weight.element_size()
    gemm = {
        "flops": 2 * positions * vocab * hidden,
        "bytes": positions * vocab * el + chunks * weight.numel() * el + positions * hidden * el,
        "launches": chunks,
        "gemm": True,
    }
    return [
        Part("soft_embedding.gemm", gemm),
        Part("soft_embedding.scale", {"bytes": 2 * positions * hidden * el}),
    ]


def _fused_sample(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    return [Part("fused_sample", _sample_cost(args[0]))]


def _soft_embedding(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    logits, weight = args[0], args[3]
    probs = {
        "bytes": logits.numel() * (logits.element_size() + weight.element_size()),
        "launches": _probs_chunks(logits, weight),
    }
    return [Part("soft_embedding.probs", probs), *_soft_cost(logits, weight)]


def _sample_and_embed(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    logits, weight = args[0], args[3]
    sample = _sample_cost(logits, weight.element_size())
    sample["launches"] = _probs_chunks(logits, weight)
    return [Part("fused_sample", sample), *_soft_cost(logits, weight)]


def _one_pass(name: str) -> Rule:
    """A memory-bound kernel of one launch that reads its inputs and writes its output once:
    `triton_norm`'s RMSNorm (x, weight, out), q/k/v norms and RoPE (q, k, v, their weights,
    cos, sin and the three outputs) and softcap (the head's output, fp32 logits), the
    Philox kernel (seeds, counters, uniforms), and `triton_layer`'s tails (the norms' inputs,
    weights, residual and layer scalar; their one or two outputs)."""

    def rule(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
        return [Part(name, {"bytes": nbytes(tensors_of(args, out))})]

    return rule


def _accept(acct: Accountant, args: tuple[Any, ...], out: Any) -> list[Part]:
    return [Part("entropy_accept", {"bytes": 2 * nbytes([args[0], out]), "launches": 2})]


CUSTOM_RULES: dict[str, Rule] = {
    "rms_norm": _one_pass("rms_norm"),
    "qkv_norm_rope": _one_pass("qkv_norm_rope"),
    "softcap": _one_pass("softcap"),
    "philox_uniform": _one_pass("philox_uniform"),
    "add_rms_norm": _one_pass("add_rms_norm"),
    "rms_norm_pair": _one_pass("rms_norm_pair"),
    "close_layer": _one_pass("close_layer"),
    "gated_act": _one_pass("gated_act"),
    "canvas_attention": _attention,
    "write_kv": _write_kv,
    "route_experts": _route,
    "fused_moe": _moe,
    "fp8_moe": _fp8_moe,
    "fp8_linear": _fp8_linear,
    "fp8_linear_rows": _fp8_linear_rows,
    "fp8_moe_rows": _fp8_moe_rows,
    # `triton_fp8_emit`: one pass each, FP8 values and fp32 scales written
    "rms_norm_fp8": _one_pass("rms_norm_fp8"),
    "rms_norm_pair_fp8": _one_pass("rms_norm_pair_fp8"),
    "gated_act_fp8": _one_pass("gated_act_fp8"),
    "fused_sample": _fused_sample,
    "soft_embedding": _soft_embedding,
    "sample_and_embed": _sample_and_embed,
    "entropy_accept": _accept,
}
