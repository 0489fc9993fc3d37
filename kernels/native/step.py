"""Native CPU per-token kernels of a forward (`step.c`), bound by the native backend
(`kernels.backends.NativeBackend`): attention's q/k/v norms and RoPE, the router, the dense MLP's
GeGLU product, and the sampler's counter-based random numbers (`philox_uniform`).

Their twins are ATen sequences (`reference.qkv_norm_rope`: three norms and two half-width
products per RoPE half; `reference.route_experts`: norm, GEMV, softmax, top-k, renormalising,
a gather; `reference_layer.gated_act`: GELU, product), 5 to 16 passes and dispatches each,
which at a small model's canvas steps cost several times the arithmetic. The C kernels do each
token in one pass (q/k/v also in bf16); other non-fp32
operands, autograd and other activations keep the twins.
"""

from __future__ import annotations

import torch

import kernels.native.bf16 as bf16
import kernels.native.norms as norms
import kernels.reference as reference
import kernels.reference_layer as reference_layer
from kernels.native.args import GegluArgs, PhiloxArgs, QkvArgs, RouteArgs
from kernels.native.build import loaded
from kernels.native.packing import PackedWeights, packed
from kernels.native.threads import addresses, norm_min_rows, split_rows, takes

# Head and hidden sizes up to which a token's rows go on the C stack (the twins beyond).
MAX_ROW = 16384


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
    """`reference.qkv_norm_rope` (q [N, Hq, D], k and v [N, Hkv, D], cos and sin [N, D]) in one
    native pass per token, fp32 or bf16 (`canvas_qkv_norm_rope_bf16`: rounded where the bf16
    twin rounds); bf16 q, k, v with tables of another dtype: the native bf16 norms
    (`norms.rms_norm`) and the twin's RoPE."""
    operands = (q, k, v, q_weight, k_weight, cos, sin)
    if bf16.takes(q, k, v, q_weight, k_weight) and not bf16.takes(cos, sin):
        return reference.qkv_norm_rope_with(norms.rms_norm, *operands, eps)
    dim = q.shape[-1]
    if (
        not (takes(*operands) or bf16.takes(*operands))
        or q.dim() != 3
        or k.shape != v.shape
        or k.dim() != 3
        or k.shape[0] != q.shape[0]
        or k.shape[2] != dim
        or q_weight.numel() != dim
        or k_weight.numel() != dim
        or cos.shape != (q.shape[0], dim)
        or sin.shape != cos.shape
        or dim % 2
        or dim > MAX_ROW
        or q.shape[0] == 0
    ):
        return reference.qkv_norm_rope(q, k, v, q_weight, k_weight, cos, sin, eps)
    lib = loaded("step")
    q, k, v = (heads_contiguous(t) for t in (q, k, v))
    qw, kw, cos, sin = (t.contiguous() for t in (q_weight, k_weight, cos, sin))
    qo, ko, vo = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    args = QkvArgs(
        **addresses(q=q, k=k, v=v, qw=qw, kw=kw, cos=cos, sin=sin, qo=qo, ko=ko, vo=vo),
        hq=q.shape[1],
        hkv=k.shape[1],
        d=dim,
        ldq=q.stride(0),
        ldk=k.stride(0),
        ldv=v.stride(0),
        eps=eps,
    )
    per_token = dim * (q.shape[1] + 2 * k.shape[1])
    bf = q.dtype is torch.bfloat16
    kernel = lib.canvas_qkv_norm_rope_bf16 if bf else lib.canvas_qkv_norm_rope
    split_rows("step", kernel, args, q.shape[0], norm_min_rows(per_token))
    return qo, ko, vo


def heads_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t [N, H, D] as is where each token's heads are contiguous (a column block of one
    projection's output over q, k and v: `qkv_norm_rope` reads it in place), else a copy."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def route_experts(
    hidden: torch.Tensor,
    scale: torch.Tensor,
    proj: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
    segments: list[int] | None = None,
    packs: PackedWeights | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route_experts` in one native pass per token. The softmax is taken over the
    top-k scores only: softmax, top-k and renormalising to one give exp(s_i - m) / sum over the
    chosen of exp(s_j - m) (the full softmax's denominator cancels), the same function up to
    rounding; the experts chosen are the same (softmax is monotonic). Fast numerics
    (`segments` ignored). bf16 operands: the same kernel reading each bf16 row into fp32 (the
    values of an fp32 copy of the rows, without the copy's pass), the projection and the
    scales in fp32 once per binding (sharper than the bf16 twin's scores, whose near-ties may
    choose another expert)."""
    del segments
    size, experts = hidden.shape[-1], proj.shape[0]
    rows_bf16 = bf16.takes(hidden, scale, proj, per_expert_scale)
    if rows_bf16:
        scale, per_expert_scale = packed(
            packs,
            "router_scales",
            (scale, per_expert_scale),
            lambda: (scale.float(), per_expert_scale.float()),
        )
    if (
        not (takes(scale, per_expert_scale) and (rows_bf16 or takes(hidden)))
        or proj.dtype not in (torch.float32, torch.bfloat16)
        or not proj.is_cpu
        or size > MAX_ROW
        or experts > MAX_ROW
        or scale.numel() != size
        or proj.shape != (experts, size)
        or per_expert_scale.numel() != experts
        or not 0 < top_k <= experts
    ):
        fp32 = hidden.float() if rows_bf16 else hidden  # the twin on the fp32 copy, as before
        return reference.route_experts(fp32, scale, proj, per_expert_scale, top_k, eps)
    lib = loaded("step")
    x = hidden.reshape(-1, size).contiguous()
    rows = x.shape[0]
    weights = torch.empty(rows, top_k, dtype=torch.float32)
    ids = torch.empty(rows, top_k, dtype=torch.int64)
    (projt,) = packed(packs, "router", (proj,), lambda: (_transposed(proj),))
    pes = per_expert_scale.contiguous()
    args = RouteArgs(
        **addresses(scale=scale.contiguous(), projt=projt, pes=pes, weights=weights, ids=ids),
        **({"xb": x.data_ptr()} if rows_bf16 else {"x": x.data_ptr()}),
        hidden=size,
        experts=experts,
        ep=projt.shape[1],
        top_k=top_k,
        eps=eps,
    )
    split_rows("step", lib.canvas_route, args, rows, norm_min_rows(size))
    return weights.view(*hidden.shape[:-1], top_k), ids.view(*hidden.shape[:-1], top_k)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`reference_layer.gated_act`: GeGLU ("gelu_pytorch_tanh") natively, in one pass; other
    activations take the twin; bf16 gate and up `bf16.gated_act`."""
    if bf16.takes(gate, up):
        return bf16.gated_act(gate, up, activation)
    if (
        activation != "gelu_pytorch_tanh"
        or gate.shape != up.shape
        or not takes(gate, up)
        or gate.numel() == 0
    ):
        return reference_layer.gated_act(gate, up, activation)
    lib = loaded("step")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g)
    args = GegluArgs(gate=g.data_ptr(), up=u.data_ptr(), out=out.data_ptr())
    split_rows("step", lib.canvas_geglu, args, g.numel(), norm_min_rows(1))
    return out


def _transposed(proj: torch.Tensor) -> torch.Tensor:
    """The router's [E, H] projection as `step.c` reads it: [H, ep], zeros past the E experts
    (ep the next multiple of the library's vector width)."""
    lanes = int(loaded("step").canvas_step_lanes())
    experts, size = proj.shape
    out = torch.zeros(size, -(-experts // lanes) * lanes, dtype=torch.float32)
    out[:, :experts] = proj.detach().t()
    return out


def philox_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`reference.philox_uniform` bit for bit (int64 CPU seeds and counters, broadcast), in
    one native pass instead of the twin's ~140 NumPy passes."""
    if seeds.device.type != "cpu" or counters.device.type != "cpu":
        return reference.philox_uniform(seeds, counters)
    lib = loaded("step")
    s, c = (t.to(torch.int64).contiguous() for t in torch.broadcast_tensors(seeds, counters))
    out = torch.empty(s.shape, dtype=torch.float32)
    if out.numel():
        args = PhiloxArgs(
            seeds=s.data_ptr(), counters=c.data_ptr(), out=out.data_ptr(), n=out.numel()
        )
        lib.canvas_philox_uniform(args)
    return out
