"""PyTorch twins of Canvas' kernels.

Each function here is the specification of one kernel: the Triton version (GPU) has the same
signature and must agree with it. The engine calls these on CPU and whenever the twins are
forced. They are written to follow the transformers reference computation order, so that on CPU
in fp32 Canvas reproduces the reference's numbers (and therefore its sampled tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma RMSNorm in fp32: x * (mean(x^2) + eps)^-0.5 * weight (weight used as is)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        h = h * weight.float()
    return h.type_as(x)


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


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention with grouped KV heads.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: bool [B, 1, T, S] (True = attend) or None
    (every query sees every key). Returns [B, Hq, T, D].
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


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
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    expert_ids, perm = torch.sort(ids.reshape(-1))  # [N*K]
    x = hidden[perm // top_k]
    counts = torch.histc(expert_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    gate, up = grouped_mm(x, gate_up, offsets).chunk(2, dim=-1)
    out = grouped_mm(F.gelu(gate, approximate="tanh") * up, down, offsets)
    out = out * weights.reshape(-1)[perm].unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    return out[inv_perm].view(num_tokens, top_k, -1).sum(dim=1).to(hidden.dtype)
