"""Native CPU experts and small dense projections (`moe.c`), bound by the native backend
(`kernels.backends.NativeBackend`).

One token (an AR step at one request): its experts' matrix-vector products and GeGLU in one
call instead of ~10 dispatches per expert. Many tokens (canvas steps, AR batches): register-
tiled expert products on weights packed once per model (`pack_experts`), where each expert's
weights fit a core's L2 cache. The twin (`reference.fused_moe_scattered`) gathers each
expert's rows, runs two grouped GEMMs (MKL, one call per expert each), weights and scatters:
more passes and dispatches than the tiles, which pay most where experts are small; larger
experts come out even, and beyond the budget the twin runs. Dense projections of at least
MIN_LINEAR_ROWS rows on weights of at most MAX_PACKED_LINEAR_BYTES (`linear`): the same
register tile on the weight packed once, faster than MKL at many rows and slower at a few
(docs/performance.md). Packed copies are kept by the kernel set bound onto the model
(`kernels.native.packing`: the `packs` argument; None packs per call).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

import kernels.native.bf16 as bf16
import kernels.native.step as step
import kernels.reference as reference
from kernels.native.args import (
    GatedLinearArgs,
    LinearArgs,
    LinearSplitArgs,
    MoeRowsArgs,
    MoeSumArgs,
    MoeTokenArgs,
)
from kernels.native.build import library, loaded, on_torch_team
from kernels.native.packing import PackedWeights, packed
from kernels.native.pairs import sort_pairs
from kernels.native.threads import addresses, over_rows, scratch, split_rows, takes, threads

# Expert weight bytes per thread below which one thread runs all of a token's experts.
MIN_EXPERT_BYTES_PER_THREAD = 4 << 20


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
    packs: PackedWeights | None = None,
) -> torch.Tensor:
    """`reference.fused_moe_scattered`; one token (an AR step at one request) in one native
    call (`moe.c`: its experts' matrix-vector products and GeGLU, each slot weighted), the
    slots summed in slot order. More tokens: `moe.c`'s tiled expert products
    (`_experts_tiled`) where the experts fit a core's L2 cache. Larger experts, non-fp32
    operands and autograd take the twin; bf16 operands go to `bf16.fused_moe`."""
    if bf16.takes(hidden, gate_up, down):
        return bf16.fused_moe(hidden, gate_up, down, weights, ids, packs)
    if not takes(hidden, gate_up, down, weights):
        return reference.fused_moe_scattered(hidden, gate_up, down, weights, ids, segments)
    if ids.shape[0] != 1:
        if not tiles(gate_up, down):
            return reference.fused_moe_scattered(hidden, gate_up, down, weights, ids, segments)
        return _experts_tiled(hidden, gate_up, down, weights, ids, packs)
    lib = loaded("moe")
    num_slots, size = ids.shape[1], hidden.shape[-1]
    inter = down.shape[-1]
    x, gu, dn = hidden.contiguous(), gate_up.contiguous(), down.contiguous()
    w = weights.reshape(-1).contiguous()
    slots = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(num_slots, size, dtype=torch.float32)
    acts = torch.empty(num_slots, inter, dtype=torch.float32)
    args = MoeTokenArgs(
        **addresses(x=x, gate_up=gu, down=dn, weights=w, ids=slots, out=out, scratch=acts),
        h=size,
        inter=inter,
    )
    expert_bytes = 3 * inter * size * 4
    min_slots = max(1, MIN_EXPERT_BYTES_PER_THREAD // expert_bytes)
    over_rows(lambda begin, end: _token_slots(lib, args, begin, end), num_slots, min_slots)
    return out.sum(0, keepdim=True)


def _token_slots(lib: object, args: MoeTokenArgs, begin: int, end: int) -> None:
    """`canvas_moe_token` over the slots [begin, end), on its own copy of `args`."""
    part = MoeTokenArgs.from_buffer_copy(args)
    part.begin, part.end = begin, end
    lib.canvas_moe_token(part)  # type: ignore[attr-defined]


# Expert weight bytes (gate, up and down) up to which `moe.c` tiles the experts: each tile of
# rows re-reads its expert's weights, which must stay in a core's L2 cache (1 MiB here).
MAX_TILED_EXPERT_BYTES = 1 << 20
# Sorted rows per thread below which one thread runs all (a hand-off costs ~50 µs).
MIN_EXPERT_ROWS_PER_THREAD = 64


def tiles(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `moe.c`'s tiled products take experts of these shapes: whole vector blocks of
    the intermediate and hidden sizes, and each expert's weights within the L2 budget."""
    lanes = moe_lanes()
    inter, hidden = down.shape[-1], down.shape[-2]
    return (
        lanes > 0
        and inter % lanes == 0
        and hidden % (2 * lanes) == 0
        and 3 * inter * hidden * 4 <= MAX_TILED_EXPERT_BYTES
    )


@functools.cache
def moe_lanes() -> int:
    """The vector width (floats) `moe.c` was compiled with; 0 without the library."""
    lib = library("moe")
    return int(lib.canvas_moe_lanes()) if lib is not None else 0


def pack_experts(
    gate_up: torch.Tensor, down: torch.Tensor, packs: PackedWeights | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.c`'s layouts of gate_up [E, 2I, H] and down [E, H, I] (see `canvas_moe_rows`):
    [E, I/V, H, 2V] (V gate then V up columns per input) and [E, H/2V, I, 2V]."""

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        lanes = moe_lanes()
        experts, hidden, inter = down.shape
        gate, up = gate_up.detach().view(experts, 2, inter // lanes, lanes, hidden).unbind(1)
        gup = torch.cat([gate.transpose(-1, -2), up.transpose(-1, -2)], -1).contiguous()
        dnp = down.detach().view(experts, hidden // (2 * lanes), 2 * lanes, inter)
        return gup, dnp.transpose(-1, -2).contiguous()

    gup, dnp = packed(packs, "experts", (gate_up, down), make)
    return gup, dnp


# Dense weights up to which `linear` packs them (a packed copy beside each: bounded memory).
MAX_PACKED_LINEAR_BYTES = 1 << 20
# Rows from which `linear` takes the tiles (below it MKL's small-M path is faster), and rows
# per thread below which one thread runs all.
MIN_LINEAR_ROWS = 128
MIN_LINEAR_ROWS_PER_THREAD = 32


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    segments: list[int],
    packs: PackedWeights | None = None,
) -> torch.Tensor:
    """`reference.linear` (x [..., M, K] @ weight [N, K]^T, fast numerics) by `moe.c`'s
    register tiles on the weight packed once ([N/2V, K, 2V]), for fp32 CPU operands of at least
    MIN_LINEAR_ROWS rows, N a multiple of 2V and the weight within MAX_PACKED_LINEAR_BYTES
    (a small model's projections); the twin otherwise. Every output's sum
    runs over K in order, so a row's value never depends on its batch. bf16 operands go to
    `bf16.linear`."""
    if bf16.takes(x, weight):
        return bf16.linear(x, weight, segments, packs)
    lanes, (n, k) = moe_lanes(), weight.shape
    rows = x.numel() // max(1, k)
    if (
        rows < MIN_LINEAR_ROWS
        or lanes == 0
        or n % (2 * lanes)
        or n * k * 4 > MAX_PACKED_LINEAR_BYTES
        or not takes(x, weight)
    ):
        return reference.linear(x, weight, segments)
    lib = loaded("moe")

    def make() -> tuple[torch.Tensor]:
        return (weight.detach().view(n // (2 * lanes), 2 * lanes, k).transpose(1, 2).contiguous(),)

    (tiled,) = packed(packs, "linear", (weight,), make)
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    args = LinearArgs(x=flat.data_ptr(), wp=tiled.data_ptr(), out=out.data_ptr(), k_dim=k, n=n)
    split_rows("moe", lib.canvas_linear, args, rows, MIN_LINEAR_ROWS_PER_THREAD)
    return out.view(*x.shape[:-1], n)


def linear_many(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    segments: list[int],
    packs: PackedWeights | None = None,
) -> list[torch.Tensor]:
    """[linear(x, w) for w in weights] (two or three projections of the same x: attention's q,
    k and v), the same values, in one pass of `moe.c`'s tiles over their weights packed once
    together, each output written to its own tensor; `linear` one by one where it would not
    take the tiles (each weight within MAX_PACKED_LINEAR_BYTES, outputs whole blocks of 2V).
    bf16 operands go to `bf16.linear_many`."""
    if bf16.takes(x, *weights):
        return bf16.linear_many(x, weights, segments, packs)
    lanes, k = moe_lanes(), weights[0].shape[1]
    rows = x.numel() // max(1, k)
    widths = [w.shape[0] for w in weights]
    if (
        rows < MIN_LINEAR_ROWS
        or lanes == 0
        or not 2 <= len(weights) <= 3
        or any(w.dim() != 2 or w.shape[1] != k for w in weights)
        or any(n % (2 * lanes) or n * k * 4 > MAX_PACKED_LINEAR_BYTES for n in widths)
        or not takes(x, *weights)
    ):
        return [linear(x, w, segments, packs) for w in weights]
    lib = loaded("moe")
    total = sum(widths)

    def make() -> tuple[torch.Tensor]:
        joined = torch.cat([w.detach() for w in weights])
        return (joined.view(total // (2 * lanes), 2 * lanes, k).transpose(1, 2).contiguous(),)

    (tiled,) = packed(packs, "linear_many", tuple(weights), make)
    flat = x.reshape(rows, k).contiguous()
    outs = [torch.empty(rows, n, dtype=torch.float32) for n in widths]
    out0, out1, *out2 = (o.data_ptr() for o in outs)
    args = LinearSplitArgs(
        x=flat.data_ptr(),
        wp=tiled.data_ptr(),
        out0=out0,
        out1=out1,
        out2=out2[0] if out2 else None,
        n0=widths[0],
        n1=widths[1],
        k_dim=k,
        n=total,
    )
    split_rows("moe", lib.canvas_linear_split, args, rows, MIN_LINEAR_ROWS_PER_THREAD)
    return [o.view(*x.shape[:-1], n) for o, n in zip(outs, widths, strict=True)]


def gated_linear(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    segments: list[int],
    packs: PackedWeights | None = None,
) -> torch.Tensor:
    """`gated_act(linear(x, gate), linear(x, up), activation)` with this module's `linear` and
    `step.gated_act`, the same values: GeGLU of at least MIN_LINEAR_ROWS fp32 rows on
    weights packed once together ([I/V, K, 2V], the experts' gate/up layout) in one pass of
    `moe.c`'s tiles (no [M, 2I] intermediates, one call instead of three); the three calls
    otherwise (other activations, small batches, large or odd-sized weights). bf16 operands
    go to `bf16.gated_linear`."""
    if bf16.takes(x, gate, up):
        return bf16.gated_linear(x, gate, up, activation, segments, packs)
    lanes, (inter, k) = moe_lanes(), gate.shape
    rows = x.numel() // max(1, k)
    if (
        activation != "gelu_pytorch_tanh"
        or rows < MIN_LINEAR_ROWS
        or lanes == 0
        or inter % lanes
        or up.shape != gate.shape
        or inter * k * 4 > MAX_PACKED_LINEAR_BYTES
        or not takes(x, gate, up)
    ):
        gate_out, up_out = linear(x, gate, segments, packs), linear(x, up, segments, packs)
        return step.gated_act(gate_out, up_out, activation)
    lib = loaded("moe")

    def make() -> tuple[torch.Tensor]:
        g, u = (w.detach().view(inter // lanes, lanes, k).transpose(1, 2) for w in (gate, up))
        return (torch.cat([g, u], -1).contiguous(),)

    (tiled,) = packed(packs, "gated", (gate, up), make)
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, inter, dtype=torch.float32)
    args = GatedLinearArgs(
        x=flat.data_ptr(), gup=tiled.data_ptr(), out=out.data_ptr(), k_dim=k, inter=inter
    )
    split_rows("moe", lib.canvas_gated_linear, args, rows, MIN_LINEAR_ROWS_PER_THREAD)
    return out.view(*x.shape[:-1], inter)


def _experts_tiled(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    packs: PackedWeights | None,
) -> torch.Tensor:
    """`reference.fused_moe_scattered` of many tokens by `moe.c`: the pairs sorted by expert
    (`canvas_moe_sort`, a counting sort), each thread a range of the sorted rows
    (`canvas_moe_rows`), every pair's weighted output at its own row, then each token's slots
    summed in slot order (`canvas_moe_sum`)."""
    lib = loaded("moe")
    num_tokens, top_k = ids.shape
    num_experts, size, inter = down.shape
    gup, dnp = pack_experts(gate_up, down, packs)
    pairs, ends = sort_pairs(ids, num_experts)
    x, w = hidden.contiguous(), weights.reshape(-1).to(torch.float32).contiguous()
    ybuf = scratch(num_tokens * top_k * size).view(num_tokens * top_k, size)
    args = MoeRowsArgs(
        **addresses(x=x, gup=gup, dnp=dnp, weights=w, pairs=pairs, ends=ends, ybuf=ybuf),
        num_experts=num_experts,
        top_k=top_k,
        h=size,
        inter=inter,
    )
    if on_torch_team("moe"):
        team = threads(pairs.numel(), MIN_EXPERT_ROWS_PER_THREAD)
        act = torch.empty(team, 16, inter, dtype=torch.float32)  # each thread's GeGLU tile
        args.act, args.begin, args.end, args.threads = act.data_ptr(), 0, pairs.numel(), team
        lib.canvas_moe_rows_parallel(args)
    else:

        def run(begin: int, end: int) -> None:
            act = torch.empty(16, inter, dtype=torch.float32)  # a tile's GeGLU rows (<= 16)
            part = MoeRowsArgs.from_buffer_copy(args)
            part.act, part.begin, part.end, part.threads = act.data_ptr(), begin, end, 1
            lib.canvas_moe_rows(part)

        over_rows(run, pairs.numel(), MIN_EXPERT_ROWS_PER_THREAD)
    out = torch.empty(num_tokens, size, dtype=torch.float32)
    total = MoeSumArgs(ybuf=ybuf.data_ptr(), out=out.data_ptr(), top_k=top_k, h=size)
    split_rows("moe", lib.canvas_moe_sum, total, num_tokens, MIN_EXPERT_ROWS_PER_THREAD)
    return out.to(hidden.dtype)
