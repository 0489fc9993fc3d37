"""bf16 dense projections and experts on the CPU (`bf16.c`): what `kernels.native.moe`'s
`linear`, `linear_many`, `gated_linear` and `fused_moe` run for bf16 operands (a model loaded
with `--dtype bfloat16`), the bf16 twins of its fp32 tiles.

bf16 weights are packed once per binding (`kernels.native.packing`) as pairs of inputs per
output column (`bf16.c`'s layout); activations stay bf16, read in place; sums run in fp32 and
outputs are rounded to bf16, as the twins' (oneDNN's bf16 GEMMs) are. The products run on AMX
tiles where the CPU has them (the experts; the dense projections with K a multiple of 32:
`bf16_amx.h`), else AVX512-BF16's `vdpbf16ps` where the CPU has it (the library is built for
this machine: `canvas_bf16_paths`), the generic vector code (the same bits, any CPU) elsewhere
or with `CANVAS_NATIVE_BF16=generic`. Shapes the tiles do not take (output widths not whole
blocks of 32 columns, weights beyond the L2 budget) and autograd run the twins; a dense
projection the tiles do not take (or that oneDNN runs faster: `tiles_first`) runs oneDNN on the
weight reordered once per binding (`kernels.native.onednn`; q/k/v, and gate with up, as one
product) where the binding decided so, the twin otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

import kernels.native.onednn as onednn
import kernels.reference as reference
import kernels.reference_layer as reference_layer
from kernels.native.args import (
    Bf16GatedArgs,
    Bf16GegluArgs,
    Bf16LinearArgs,
    Bf16MoeArgs,
    Bf16SumArgs,
)
from kernels.native.build import cpu_flags, library, loaded, on_torch_team
from kernels.native.packing import PackedWeights, packed
from kernels.native.pairs import sort_pairs
from kernels.native.threads import addresses, norm_min_rows, scratch, split_rows, threads

BLOCK = 32  # output columns per tile (two vectors of 16)
LANES = 16
AMX_ROWS = 16  # bf16_amx.h's


def scratch_elements(hidden: int, inter: int) -> int:
    """bf16_amx.h's BF_SCRATCH: bf16 elements of each thread's expert scratch."""
    return AMX_ROWS * (hidden + inter) + 4 * AMX_ROWS * LANES


# The paths `CANVAS_NATIVE_BF16` names, fastest first: bf16.c's `path` argument, each its bit
# in `canvas_bf16_paths` (amx: the experts on AMX tiles, the dense tiles on vdpbf16ps).
PATHS = {"amx": 4, "avx512_bf16": 2, "generic": 1}
# Weight bytes up to which the projections pack and tile a weight (a small model's: a packed
# copy beside each, bounded memory), and an expert's bytes (gate, up and down) up to which its
# tiles re-read it from a core's L2 cache.
MAX_PACKED_BYTES = 1 << 20
MAX_EXPERT_BYTES = 1 << 20
# Rows per thread below which one thread runs all (a hand-off costs ~50 µs).
MIN_ROWS_PER_THREAD = 32
MIN_EXPERT_ROWS_PER_THREAD = 64
# Rows from which a dense projection that fits the AMX tiles runs oneDNN instead (`tiles_first`).
AMX_MAX_ROWS = 1024


def takes(*tensors: torch.Tensor | None) -> bool:
    """Whether these operands go to the bf16 kernels: bf16 CPU tensors (None: no operand), no
    autograd, `bf16.c` built."""
    if torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and (t.dtype is not torch.bfloat16 or not t.is_cpu):
            return False
    return library("bf16") is not None


def paths() -> tuple[str, ...]:
    """The paths this machine's library has, fastest first."""
    lib = library("bf16")
    bits = int(lib.canvas_bf16_paths()) if lib is not None else 0
    return tuple(name for name, bit in PATHS.items() if bits & bit)


def path() -> int:
    """bf16.c's `path` argument: `CANVAS_NATIVE_BF16` (auto, the default: the fastest this
    machine has; generic; avx512_bf16). ValueError naming the variable for another value or a
    path this CPU lacks."""
    name = os.environ.get("CANVAS_NATIVE_BF16", "auto") or "auto"
    have = paths()
    if name == "auto":
        return PATHS[have[0]] if have else PATHS["generic"]
    if name not in PATHS:
        raise ValueError(f"CANVAS_NATIVE_BF16 must be auto, {', '.join(PATHS)}; got {name!r}")
    if name not in have:
        raise ValueError(f"CANVAS_NATIVE_BF16={name}: this CPU's library has only {have}")
    return PATHS[name]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (N a multiple of BLOCK) as bf16.c's [N / 32, pairs, 2, 16, 2]: for each
    block of 32 columns and input pair, each column's two weights side by side (K padded to
    even with zeros)."""
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.detach(), (0, k % 2))
    return w.view(n // BLOCK, 2, LANES, -1, 2).permute(0, 3, 1, 2, 4).contiguous()


def pack_gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up [..., I, K] (I a multiple of 16) as [..., I / 16, pairs, 2, 16, 2]: for each
    block of 16 columns and input pair, the gate's then the up's 16 columns, their two weights
    side by side (K padded to even)."""
    *lead, inter, k = gate.shape
    both = torch.nn.functional.pad(torch.stack([gate.detach(), up.detach()], -3), (0, k % 2))
    blocks = both.view(*lead, 2, inter // LANES, LANES, -1, 2)
    d = len(lead)
    order = (*range(d), d + 1, d + 3, d, d + 2, d + 4)
    return blocks.permute(order).contiguous()


def _fits(n: int, k: int) -> bool:
    return n % BLOCK == 0 and n * k * 2 <= MAX_PACKED_BYTES


def onednn_amx() -> bool:
    """Whether the twins' bf16 GEMMs (oneDNN's) run on AMX tiles here: the CPU has amx_bf16 and
    ONEDNN_MAX_CPU_ISA does not cap oneDNN below it. Then a dense bf16 projection takes oneDNN
    (`dense`), an order of magnitude faster than `bf16.c`'s AVX512-BF16 tiles (docs/performance.md);
    without AMX the tiles are at least as fast as oneDNN's and keep a row's bits batch-free."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return "amx_bf16" in cpu_flags() and (isa in ("ALL", "DEFAULT") or "AMX" in isa)


def amx_dense(k: int) -> bool:
    """Whether the dense tiles run on AMX here: the amx path (`path`) and K a multiple of 32
    (bf16.c's `amx_dense_rows`; the vdpbf16ps tiles otherwise)."""
    return k % 32 == 0 and path() == PATHS["amx"]


def tiles_first(k: int, rows: int) -> bool:
    """Whether a dense projection of `rows` rows over K inputs that fits the tiles takes them
    before oneDNN: where oneDNN has no AMX (`onednn_amx`), or the tiles run on AMX and the rows
    are fewer than AMX_MAX_ROWS (one native call and no oneDNN primitive per projection: a
    small model's projections are a few microseconds of work; from there on oneDNN's blocking
    beats the tiles', and a row may round one ulp apart across that batch size)."""
    return not onednn_amx() or (amx_dense(k) and rows < AMX_MAX_ROWS)


def linear(
    x: torch.Tensor, weight: torch.Tensor, segments: list[int] | None, packs: PackedWeights | None
) -> torch.Tensor:
    """`reference.linear` for bf16 operands: `linear_tiles` where N is whole blocks of 32, the
    weight within MAX_PACKED_BYTES and the tiles go first (`tiles_first`); `dense` otherwise."""
    return linear_many(x, [weight], segments, packs)[0]


def dense(
    x: torch.Tensor, weight: torch.Tensor, segments: list[int] | None, packs: PackedWeights | None
) -> torch.Tensor:
    """The twin's product (`reference.linear`: oneDNN's bf16 GEMM, which reorders the weight on
    every call), on the weight reordered once into oneDNN's layout (`onednn.reorder`, kept in
    the binding's `packs` and redone when the weight changes in place) where the binding chose
    oneDNN (`PackedWeights.onednn`) and the operands fit (`onednn.fits`): the same sums, the
    twin's values within a bf16 ulp. Without a binding (`packs` None) the twin."""
    if packs is None or not packs.onednn or not onednn.fits(x, weight):
        return reference.linear(x, weight, segments or [])
    (reordered,) = packs.get("bf16_onednn", (weight,), lambda: (onednn.reorder(weight),))
    return onednn.linear(x, reordered)


def linear_many(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    segments: list[int] | None,
    packs: PackedWeights | None,
) -> list[torch.Tensor]:
    """[linear(x, w) for w in weights]: `linear_tiles` of all in one pass where every weight
    fits the tiles and they go first (`tiles_first`), `dense` one by one otherwise."""
    k = weights[0].shape[-1]
    if (
        not tiles_first(k, x.numel() // max(1, k))
        or len(weights) > 3
        or not all(w.dim() == 2 and w.shape[1] == k and _fits(w.shape[0], k) for w in weights)
    ):
        return dense_many(x, weights, segments, packs)
    return linear_tiles(x, weights, packs)


def _joined(packs: PackedWeights | None, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `dense_many` runs these weights as one oneDNN product: the binding chose oneDNN
    and every weight fits it (`onednn.fits`) with the same K."""
    return (
        packs is not None
        and packs.onednn
        and len(weights) > 1
        and all(onednn.fits(x, w) for w in weights)
    )


def dense_many(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    segments: list[int] | None,
    packs: PackedWeights | None,
) -> list[torch.Tensor]:
    """[dense(x, w) for w in weights]: one oneDNN product over the weights stacked and
    reordered once together (a binding that chose oneDNN, `_joined`), each output a view of its
    columns of the one result (rows `sum(N_i)` apart: `step.qkv_norm_rope` reads q, k and v in
    place); `dense` one by one otherwise. The same sums as one by one (their values within a
    bf16 ulp of those, as oneDNN's are of each other across batches)."""
    if not _joined(packs, x, weights):
        return [dense(x, w, segments, packs) for w in weights]
    assert packs is not None
    (reordered,) = packs.get(
        "bf16_onednn_many",
        tuple(weights),
        lambda: (onednn.reorder(torch.cat([w.detach() for w in weights])),),
    )
    out = onednn.linear(x, reordered)
    return list(out.split([w.shape[0] for w in weights], dim=-1))


def linear_tiles(
    x: torch.Tensor, weights: Sequence[torch.Tensor], packs: PackedWeights | None
) -> list[torch.Tensor]:
    """x [..., K] @ w^T for each of one to three weights w [N_i, K] (N_i whole blocks of 32) by
    `bf16.c`'s tiles, in one pass over the weights packed once together (`pack`), each output
    its own bf16 tensor. Every output's sum runs over K in order: a row's value never depends
    on its batch."""
    k = weights[0].shape[-1]
    widths = [w.shape[0] for w in weights]
    rows = x.numel() // max(1, k)
    kind = f"bf16_linear_{len(weights)}"
    (tiled,) = packed(packs, kind, tuple(weights), lambda: (pack(torch.cat(list(weights))),))
    flat = x.reshape(rows, k).contiguous()
    outs = [torch.empty(rows, n, dtype=torch.bfloat16) for n in widths]
    ptrs = [o.data_ptr() for o in outs] + [None] * (3 - len(outs))
    args = Bf16LinearArgs(
        x=flat.data_ptr(),
        wp=tiled.data_ptr(),
        out0=ptrs[0],
        out1=ptrs[1],
        out2=ptrs[2],
        n0=widths[0],
        n1=widths[1] if len(widths) > 1 else 0,
        k_dim=k,
        n=sum(widths),
        path=path(),
    )
    split_rows("bf16", loaded("bf16").canvas_bf16_linear, args, rows, MIN_ROWS_PER_THREAD)
    return [o.view(*x.shape[:-1], n) for o, n in zip(outs, widths, strict=True)]


def gated_linear(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    segments: list[int] | None,
    packs: PackedWeights | None,
) -> torch.Tensor:
    """`gated_act(linear(x, gate), linear(x, up), activation)` for bf16 operands: `gated_tiles`
    for GeGLU where gate and up fit and the tiles go first (`tiles_first`); else for GeGLU one
    oneDNN product over gate and up reordered once together where the binding chose oneDNN
    (`dense_many`) and bf16.c's GeGLU over its halves; the three calls otherwise."""
    inter, k = gate.shape
    if (
        not tiles_first(k, x.numel() // max(1, k))
        or activation != "gelu_pytorch_tanh"
        or inter % LANES
        or up.shape != gate.shape
        or inter * k * 2 > MAX_PACKED_BYTES
    ):
        geglu = activation == "gelu_pytorch_tanh" and up.shape == gate.shape
        if not (geglu and _joined(packs, x, [gate, up])):
            gate_out, up_out = linear(x, gate, segments, packs), linear(x, up, segments, packs)
            return gated_act(gate_out, up_out, activation)
        # one oneDNN product over [gate; up], the GeGLU straight from its rows' halves
        gate_out, up_out = dense_many(x, [gate, up], segments, packs)
        out = _geglu(gate_out, up_out, x.numel() // max(1, k), inter, 2 * inter)
        return out.view(*x.shape[:-1], inter)
    return gated_tiles(x, gate, up, packs)


def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`reference_layer.gated_act` for bf16 gate and up: GeGLU in one native pass, rounded
    where the twin rounds (GELU's output, the product); other activations and shapes take the
    twin."""
    if activation != "gelu_pytorch_tanh" or gate.shape != up.shape or gate.numel() == 0:
        return reference_layer.gated_act(gate, up, activation)
    g, u = gate.contiguous(), up.contiguous()
    width = g.shape[-1]
    return _geglu(g, u, g.numel() // max(1, width), width, width).view(g.shape)


def _geglu(gate: torch.Tensor, up: torch.Tensor, rows: int, width: int, ld: int) -> torch.Tensor:
    """bf16.c's GeGLU over `rows` rows of `width` from gate's and up's first elements, their
    rows `ld` apart: a new [rows, width]."""
    out = torch.empty(rows, width, dtype=torch.bfloat16)
    args = Bf16GegluArgs(
        gate=gate.data_ptr(), up=up.data_ptr(), out=out.data_ptr(), width=width, ld=ld
    )
    split_rows("bf16", loaded("bf16").canvas_bf16_geglu, args, rows, norm_min_rows(width))
    return out


def gated_tiles(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, packs: PackedWeights | None
) -> torch.Tensor:
    """gelu_tanh(x @ gate^T) * (x @ up^T) (gate, up [I, K], I whole vectors of 16) in one pass
    of `bf16.c`'s tiles over the two packed once together (`pack_gated`): gate and up in fp32,
    their GeGLU rounded once to bf16."""
    inter, k = gate.shape
    rows = x.numel() // max(1, k)
    (tiled,) = packed(packs, "bf16_gated", (gate, up), lambda: (pack_gated(gate, up),))
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    args = Bf16GatedArgs(
        x=flat.data_ptr(), gup=tiled.data_ptr(), out=out.data_ptr(), k_dim=k, inter=inter
    )
    args.path = path()
    lib = loaded("bf16")
    split_rows("bf16", lib.canvas_bf16_gated_linear, args, rows, MIN_ROWS_PER_THREAD)
    return out.view(*x.shape[:-1], inter)


def tiles(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether bf16.c's expert tiles take experts of these shapes: the intermediate size whole
    vectors of 16, the hidden size whole blocks of 32, each expert within MAX_EXPERT_BYTES."""
    inter, hidden = down.shape[-1], down.shape[-2]
    return inter % LANES == 0 and hidden % BLOCK == 0 and 3 * inter * hidden * 2 <= MAX_EXPERT_BYTES


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    packs: PackedWeights | None,
) -> torch.Tensor:
    """`reference.fused_moe_scattered` for bf16 hidden states and experts: the pairs sorted by
    expert (`pairs.sort_pairs`), bf16.c's tiles over each expert's rows (gate and up in fp32,
    their GeGLU rounded to bf16 as the twin's, the down projection in fp32 weighted by the
    router's fp32 weight), each token's slots summed in fp32 in slot order and rounded to bf16.
    Experts the tiles do not take run the twin."""
    if not tiles(gate_up, down):
        return reference.fused_moe_scattered(hidden, gate_up, down, weights, ids)
    lib = loaded("bf16")
    num_tokens, top_k = ids.shape
    num_experts, size, inter = down.shape

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = gate_up.view(num_experts, 2, inter, size).unbind(1)
        return pack_gated(gate, up), torch.stack([pack(d) for d in down.detach()])

    gup, dnp = packed(packs, "bf16_experts", (gate_up, down), make)
    pairs, ends = sort_pairs(ids, num_experts)
    x, w = hidden.contiguous(), weights.reshape(-1).to(torch.float32).contiguous()
    ybuf = scratch(num_tokens * top_k * size).view(num_tokens * top_k, size)
    team = threads(pairs.numel(), MIN_EXPERT_ROWS_PER_THREAD) if on_torch_team("bf16") else 1
    act = torch.empty(team, scratch_elements(size, inter), dtype=torch.bfloat16)
    args = Bf16MoeArgs(
        **addresses(x=x, gup=gup, dnp=dnp, weights=w, pairs=pairs, ends=ends, ybuf=ybuf, act=act),
        num_experts=num_experts,
        top_k=top_k,
        h=size,
        inter=inter,
        path=path(),
        begin=0,
        end=pairs.numel(),
        threads=team,
    )
    lib.canvas_bf16_moe_rows(args)
    out = torch.empty(num_tokens, size, dtype=torch.bfloat16)
    total = Bf16SumArgs(ybuf=ybuf.data_ptr(), out=out.data_ptr(), top_k=top_k, h=size)
    split_rows("bf16", lib.canvas_bf16_moe_sum, total, num_tokens, MIN_EXPERT_ROWS_PER_THREAD)
    return out
