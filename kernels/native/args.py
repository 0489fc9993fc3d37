"""One `ctypes.Structure` per C kernel call: the fields of the C `typedef struct` the kernel
takes a pointer to (`sampler.c`, `norms.c`, `moe.c`, `attention.c`, `step.c`, `bf16.c`), by
name and type, in the same order. Pointers are data addresses (`Tensor.data_ptr()`; None for NULL).
A struct over rows ends in `begin`, `end` (the rows [begin, end)) and `threads`
(`kernels.native.threads.split_rows` sets them)."""

from __future__ import annotations

import ctypes

PTR = ctypes.c_void_p
I64 = ctypes.c_int64
F32 = ctypes.c_float
RANGE = [("begin", I64), ("end", I64), ("threads", I64)]


def pointers(*names: str) -> list[tuple[str, type]]:
    return [(name, PTR) for name in names]


def integers(*names: str) -> list[tuple[str, type]]:
    return [(name, I64) for name in names]


class SampleArgs(ctypes.Structure):
    _fields_ = [
        ("logits", PTR),
        ("vocab", I64),
        *pointers("temperature", "uniform", "probs", "sample", "argmax", "entropy", "lse"),
        *RANGE,
    ]


class NormArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "w", "residual", "out"),
        *integers("begin", "end", "h"),
        ("eps", F32),
        ("threads", I64),
    ]


class NormPairArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "wa", "wb", "out_a", "out_b"),
        *integers("begin", "end", "h"),
        ("eps", F32),
        ("threads", I64),
    ]


class CloseLayerArgs(ctypes.Structure):
    _fields_ = [
        *pointers("dense", "moe", "residual", "wd", "wm", "w", "scale"),
        ("scale_per_row", I64),
        ("out", PTR),
        *integers("begin", "end", "h"),
        ("eps", F32),
        ("threads", I64),
    ]


class MoeTokenArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "gate_up", "down", "weights", "ids", "out", "scratch"),
        *integers("begin", "end", "h", "inter"),
    ]


class MoeRowsArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "gup", "dnp", "weights", "pairs", "ends", "ybuf", "act"),
        *integers("num_experts", "top_k", "h", "inter"),
        *RANGE,
    ]


class MoeSortArgs(ctypes.Structure):
    _fields_ = [("ids", PTR), *integers("num_pairs", "num_experts"), *pointers("pairs", "ends")]


class MoeSumArgs(ctypes.Structure):
    _fields_ = [*pointers("ybuf", "out"), *integers("top_k", "h"), *RANGE]


class LinearArgs(ctypes.Structure):
    _fields_ = [*pointers("x", "wp", "out"), *integers("k_dim", "n"), *RANGE]


class LinearSplitArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "wp", "out0", "out1", "out2"),
        *integers("n0", "n1", "k_dim", "n"),
        *RANGE,
    ]


class GatedLinearArgs(ctypes.Structure):
    _fields_ = [*pointers("x", "gup", "out"), *integers("k_dim", "inter"), *RANGE]


class AttentionArgs(ctypes.Structure):
    _fields_ = [
        *pointers("q", "k", "v", "k_pool", "v_pool"),
        *pointers("start", "offset", "count", "decode", "page_table", "items", "out", "scratch"),
        *integers("max_pages", "hq", "hkv", "d", "size", "window", "qblock"),
        ("scale", F32),
        ("lmax", I64),
        ("bf", I64),
        *RANGE,
    ]


class QkvArgs(ctypes.Structure):
    _fields_ = [
        *pointers("q", "k", "v", "qw", "kw", "cos", "sin", "qo", "ko", "vo"),
        *integers("hq", "hkv", "d", "ldq", "ldk", "ldv"),
        ("eps", F32),
        *RANGE,
    ]


class RouteArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "scale", "projt", "pes", "weights", "ids", "xb"),
        *integers("hidden", "experts", "ep", "top_k"),
        ("eps", F32),
        *RANGE,
    ]


class GegluArgs(ctypes.Structure):
    _fields_ = [*pointers("gate", "up", "out"), *RANGE]


class PhiloxArgs(ctypes.Structure):
    _fields_ = [*pointers("seeds", "counters", "out"), ("n", I64)]


class Bf16LinearArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "wp", "out0", "out1", "out2"),
        *integers("n0", "n1", "k_dim", "n", "path"),
        *RANGE,
    ]


class Bf16GatedArgs(ctypes.Structure):
    _fields_ = [*pointers("x", "gup", "out"), *integers("k_dim", "inter", "path"), *RANGE]


class Bf16MoeArgs(ctypes.Structure):
    _fields_ = [
        *pointers("x", "gup", "dnp", "weights", "pairs", "ends", "ybuf", "act"),
        *integers("num_experts", "top_k", "h", "inter", "path"),
        *RANGE,
    ]


class Bf16GegluArgs(ctypes.Structure):
    _fields_ = [*pointers("gate", "up", "out"), *integers("width", "ld"), *RANGE]


class Bf16SumArgs(ctypes.Structure):
    _fields_ = [*pointers("ybuf", "out"), *integers("top_k", "h"), *RANGE]


# Each library's kernels: name -> the struct it takes a pointer to.
SIGNATURES: dict[str, dict[str, type[ctypes.Structure]]] = {
    "sampler": {"canvas_sample_rows": SampleArgs},
    "norms": {
        "canvas_rms_norm": NormArgs,
        "canvas_rms_norm_pair": NormPairArgs,
        "canvas_close_layer": CloseLayerArgs,
        "canvas_rms_norm_bf16": NormArgs,
        "canvas_rms_norm_pair_bf16": NormPairArgs,
        "canvas_close_layer_bf16": CloseLayerArgs,
    },
    "moe": {
        "canvas_moe_token": MoeTokenArgs,
        "canvas_moe_rows": MoeRowsArgs,
        "canvas_moe_rows_parallel": MoeRowsArgs,
        "canvas_linear": LinearArgs,
        "canvas_gated_linear": GatedLinearArgs,
        "canvas_linear_split": LinearSplitArgs,
        "canvas_moe_sort": MoeSortArgs,
        "canvas_moe_sum": MoeSumArgs,
    },
    "attention": {"canvas_attention": AttentionArgs},
    "step": {
        "canvas_qkv_norm_rope": QkvArgs,
        "canvas_qkv_norm_rope_bf16": QkvArgs,
        "canvas_route": RouteArgs,
        "canvas_geglu": GegluArgs,
        "canvas_philox_uniform": PhiloxArgs,
    },
    "bf16": {
        "canvas_bf16_linear": Bf16LinearArgs,
        "canvas_bf16_gated_linear": Bf16GatedArgs,
        "canvas_bf16_moe_rows": Bf16MoeArgs,
        "canvas_bf16_moe_sum": Bf16SumArgs,
        "canvas_bf16_geglu": Bf16GegluArgs,
    },
}
