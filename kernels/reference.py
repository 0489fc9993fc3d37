"""PyTorch twins of Canvas' kernels.

Each function here is the specification of one kernel: the Triton version (GPU) has the same
signature and must agree with it. The engine calls these on CPU and whenever the twins are
forced. They are written to follow the transformers reference computation order, so that on CPU
in fp32 Canvas reproduces the reference's numbers (and therefore its sampled tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels.reference_norm import SMALL_NORM, rms_norm, rms_norm_fused


def apply_rope_fused(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, `engine.model.layers.apply_rope`'s values bit for bit (both numerics), in
    half-width passes written into one output, without the rotated copy. x [B, T, H, D] with
    cos, sin [B, T, D], or x [N, H, D] with cos, sin [N, D]. cos and sin repeat their first half
    (`DiffusionLM._rope` builds them from cat(freqs, freqs)), so out = (x1 c - x2 s,
    x2 c + x1 s) with c, s the first halves. Each product is rounded on its own, as in
    `apply_rope`: no fused multiply-add (`addcmul` fuses in its vectorised loop but not in its
    scalar tail, so a value would depend on where the batch's size puts it).

    A few tokens (up to `SMALL_NORM` elements: an AR step's) take `apply_rope`'s own sequence,
    x * cos + rotate_half(x) * sin — the same products and sums, so the same bits, in 9
    dispatches instead of 16 (the step's cost there is dispatches, not passes)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if x.numel() <= SMALL_NORM:
        rotated = torch.cat((-x2, x1), dim=-1)  # a - b is a + (-b), exactly
        return x * cos[..., None, :] + rotated * sin[..., None, :]
    c, s = cos[..., None, :half], sin[..., None, :half]
    if torch.is_grad_enabled():  # training: autograd takes no out= and no in-place here
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = torch.empty_like(x)
    torch.mul(x1, c, out=out[..., :half]).sub_(x2 * s)
    torch.mul(x2, c, out=out[..., half:]).add_(x1 * s)
    return out


def qkv_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gemma attention's per-head norms and RoPE in fast numerics: q [N, Hq, D] and
    k [N, Hkv, D] RMS-normed with their weights (used as is), then rotated by cos, sin [N, D]
    (`apply_rope_fused`: the halves repeat; partial and proportional RoPE are in the tables,
    cos 1 and sin 0 on the dimensions left unrotated); v [N, Hkv, D] (may be k itself: a full
    layer's V is the raw k_proj output) normed without weight and not rotated. Returns new
    (q, k, v) of the inputs' shapes and dtype."""
    return qkv_norm_rope_with(rms_norm_fused, q, k, v, q_weight, k_weight, cos, sin, eps)


def qkv_norm_rope_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope` with the reference-exact norm (`rms_norm`): exact numerics."""
    return qkv_norm_rope_with(rms_norm, q, k, v, q_weight, k_weight, cos, sin, eps)


def qkv_norm_rope_with(
    norm: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor],
    *args: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope`'s sequence with a given norm: the norms, then RoPE on q and k."""
    q, k, v, q_weight, k_weight, cos, sin, eps = args
    q = apply_rope_fused(norm(q, q_weight, eps), cos, sin)
    k = apply_rope_fused(norm(k, k_weight, eps), cos, sin)
    return q, k, norm(v, None, eps)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The LM head's soft cap: cap * tanh(logits / cap) in fp32 (without a cap: fp32 only).
    In place on fp32 logits (the [rows, vocab] buffer is a step's largest), so autograd cannot
    run through it; on other dtypes the fp32 copy is capped."""
    logits = logits.float()
    return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


# sgemm row results depend on the number of rows only below this many rows (a different
# small-M code path); at or above it each row's result is independent of the others.
SMALL_ROWS = 16


def segment_linear(x: torch.Tensor, weight: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """x [..., N, In] @ weight[Out, In]^T where the N rows come from requests of `segments`
    rows each. Batch-invariant: every row gets the value it gets when its request runs alone
    (segments shorter than SMALL_ROWS are multiplied on their own)."""
    if len(segments) == 1 or min(segments) >= SMALL_ROWS:
        return F.linear(x, weight)
    flat = x.reshape(-1, x.shape[-1])
    parts, start = [], 0
    for n in segments:
        parts.append(F.linear(flat[start : start + n], weight))
        start += n
    return torch.cat(parts).view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """x [..., N, In] @ weight[Out, In]^T as one GEMM over all rows (fast numerics: a row's
    value may differ in the last bit with the batch it shares, which `segment_linear` avoids)."""
    del segments
    return F.linear(x, weight)


def route_experts(
    hidden: torch.Tensor,
    scale: torch.Tensor,
    proj: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
    segments: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiffusionGemma router. hidden: [N, H]. Returns (weights [N, K], expert ids [N, K]).

    softmax over experts of proj(rmsnorm(hidden) * scale / sqrt(H)), top-k, renormalised to sum
    to one, then multiplied by the chosen experts' per_expert_scale.
    """
    h = rms_norm(hidden, None, eps) * scale * hidden.shape[-1] ** -0.5
    scores = segment_linear(h, proj, segments or [h.shape[0]])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k=top_k, dim=-1)
    weights /= weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[ids], ids


# Pairs per program of `triton_moe.align_pairs` (its count and placement kernels).
ALIGN_CHUNK = 128


def align_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of `align_pairs`' output: every pair plus each used expert's padding to a whole
    block, bounded on the host (nothing waits for the device)."""
    padding = min(num_experts, num_pairs) * (block_m - 1)
    return -(-(num_pairs + padding) // block_m) * block_m


def align_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the N*K token-expert pairs of ids [N, K] (pair = token * K + slot) by expert, in
    pair order within an expert (a stable sort), each expert padded to whole blocks of
    `block_m` rows. Returns (sorted pair ids [capacity] int32, padding rows = N*K; expert of
    each block [capacity / block_m] int32, num_experts for unused blocks). The Triton experts'
    grouping (`triton_moe.align_pairs`); ids are < num_experts by contract."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # Counts by a scatter into E bins: `bincount` sizes its output from the largest id, which
    # CUDA reads back to the host.
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    expert_sorted = flat[order]
    rank = (
        torch.arange(num_pairs, device=ids.device)
        - (torch.cumsum(counts, 0) - counts)[expert_sorted]
    )
    dest = (padded_end - padded)[expert_sorted] + rank
    capacity = align_capacity(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_pairs, block_expert


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of x [S, In] grouped by expert (offsets [E] = cumulative row counts, int32) times
    weight [E, Out, In]^T. Returns [S, Out]."""
    w = weight.transpose(-2, -1)
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x.to(w.dtype), w, offs=offsets)
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[expert], out=out[start:end])
        start = end
    return out


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """Mixture of GeGLU(tanh) experts. hidden: [N, H]; gate_up: [E, 2I, H]; down: [E, H, I];
    weights, ids: [N, K]. Returns [N, H] = sum_k weights[n,k] * expert_{ids[n,k]}(hidden[n]).

    Token-expert pairs are sorted by expert, run through grouped GEMMs, weighted, put back in
    (token, slot) order and summed over the slots — the order transformers' default
    ("grouped_mm") experts path uses, so CPU results match it bit for bit. With `segments`
    (rows per request), each request's tokens are grouped on their own: expert group sizes, and
    so every value, are what the request gets alone (batch invariance).
    """
    if segments is not None and len(segments) > 1:
        parts, start = [], 0
        for n in segments:
            end = start + n
            parts.append(
                fused_moe(hidden[start:end], gate_up, down, weights[start:end], ids[start:end])
            )
            start = end
        return torch.cat(parts)
    out, perm = _expert_outputs(hidden, gate_up, down, weights, ids)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    out = out.index_select(0, inv_perm)
    return out.view(*ids.shape, -1).sum(dim=1).to(hidden.dtype)


def fused_moe_scattered(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """`fused_moe` for fast numerics (all tokens grouped together; `segments` ignored): the
    weighted expert outputs are added into their tokens' rows in expert order (one scattered
    pass instead of a gather and a sum over the slots; the last bit may differ)."""
    del segments
    if ids.shape[0] == 1 and hidden.device.type == "cpu" and not torch.is_grad_enabled():
        return _one_token_moe(hidden, gate_up, down, weights, ids)
    out, perm = _expert_outputs(hidden, gate_up, down, weights, ids)
    acc = out.new_zeros(ids.shape[0], out.shape[1])
    return acc.index_add_(0, perm // ids.shape[1], out).to(hidden.dtype)


def _one_token_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe_scattered` of one token (an AR step at one request) on the CPU: its K experts
    one after another, each two matrix-vector products on views of the expert's weights, added
    in expert order. The grouped path sorts, gathers and scatters, and its grouped GEMMs visit
    every expert (~2x the time at one token); here every expert gets the same single row, so
    the values are the grouped path's. ids are read on the host (no device to wait for)."""
    acc = hidden.new_zeros(1, hidden.shape[-1], dtype=torch.float32)
    scale = weights.reshape(-1)
    for slot, expert in sorted(enumerate(ids[0].tolist()), key=lambda pair: pair[1]):
        gate, up = F.linear(hidden, gate_up[expert]).chunk(2, dim=-1)
        out = F.linear(F.gelu(gate, approximate="tanh").mul_(up), down[expert])
        acc += out * scale[slot] if out.dtype == scale.dtype else out.float() * scale[slot]
    return acc.to(hidden.dtype)


def _expert_outputs(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (token, slot) pair's weighted expert output [N*K, H], in expert order, and the
    order (perm: pair index of each row)."""
    top_k, num_experts = ids.shape[1], gate_up.shape[0]
    expert_ids, perm = torch.sort(ids.reshape(-1))  # [N*K]
    # Gathers by index_select (a plain row copy: the values of advanced indexing, faster on
    # CPU); group ends by a binary search over the sorted ids (the cumulative counts).
    x = hidden.index_select(0, perm // top_k)
    experts = torch.arange(num_experts, device=ids.device, dtype=expert_ids.dtype)
    offsets = torch.searchsorted(expert_ids, experts, right=True).to(torch.int32)
    gate, up = grouped_mm(x, gate_up, offsets).chunk(2, dim=-1)
    out = grouped_mm(F.gelu(gate, approximate="tanh").mul_(up), down, offsets)
    scale = weights.reshape(-1).index_select(0, perm).unsqueeze(-1)
    out = out.mul_(scale) if out.dtype == scale.dtype else out * scale  # fp32, as unfused
    return out, perm


# The paged attention's and the sampler's twins live in their own modules; they are part of this
# one's namespace (the Triton launchers are looked up here by name).
from kernels.reference_attention import (  # noqa: E402
    PagedRows,
    attention,
    canvas_attention,
    canvas_attention_rowwise,
    gather_pages,
    prefix_range,
    write_kv,
)
from kernels.reference_fp8 import (  # noqa: E402
    dequantize_fp8,
    fp8_linear,
    fp8_linear_rows,
    fp8_moe_rows,
    fp8_moe_with,
    gated_act_fp8,
    quantize_fp8_rows,
    rms_norm_fp8,
    rms_norm_pair_fp8,
)
from kernels.reference_layer import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_exact,
    close_layer,
    close_layer_exact,
    gated_act,
    rms_norm_pair,
    rms_norm_pair_exact,
)
from kernels.reference_sampler import (  # noqa: E402
    SampleResult,
    entropy_accept,
    fused_sample,
    philox_uniform,
    sample_and_embed,
    soft_embedding,
)

# The twins' experts over FP8 weights: dequantized, then fast numerics' scattered combine.
fp8_moe = fp8_moe_with(fused_moe_scattered)

__all__ = [
    "ALIGN_CHUNK",
    "PagedRows",
    "SMALL_NORM",
    "SMALL_ROWS",
    "SampleResult",
    "add_rms_norm",
    "add_rms_norm_exact",
    "align_capacity",
    "align_pairs",
    "apply_rope_fused",
    "attention",
    "canvas_attention",
    "canvas_attention_rowwise",
    "close_layer",
    "close_layer_exact",
    "dequantize_fp8",
    "entropy_accept",
    "fp8_linear",
    "fp8_linear_rows",
    "fp8_moe",
    "fp8_moe_rows",
    "fp8_moe_with",
    "fused_moe",
    "fused_moe_scattered",
    "fused_sample",
    "gated_act",
    "gated_act_fp8",
    "gather_pages",
    "grouped_mm",
    "linear",
    "philox_uniform",
    "prefix_range",
    "qkv_norm_rope",
    "qkv_norm_rope_exact",
    "qkv_norm_rope_with",
    "quantize_fp8_rows",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_fused",
    "rms_norm_pair",
    "rms_norm_pair_fp8",
    "rms_norm_pair_exact",
    "route_experts",
    "sample_and_embed",
    "segment_linear",
    "soft_embedding",
    "softcap",
    "write_kv",
]
