"""Native CPU kernels: C compiled at first use with the system compiler (`build`), called
through ctypes with one argument struct per call (`args`), bound by the native backend
(`kernels.backends.NativeBackend`: `--kernels native`, and `auto` on the CPU in fast numerics
where the libraries build).

The CPU fast path's twins are sequences of ATen operations, each one pass over its tensors.
Where a kernel makes many passes over a large tensor the passes, not the arithmetic, cost the
time. `sampler.c` (`sampler`): the diffusion sampler's ~15 passes over the [positions,
vocabulary] logits as three per row that stay in the core's cache. `norms.c` (`norms`): RMSNorm
and a layer's norm tails one row at a time. `moe.c` (`moe`): one token's experts in one call,
many tokens' experts and small dense projections as register-tiled products on packed weights
(`packing`). `attention.c` (`attention`): canvas attention read straight from the paged KV
cache. `step.c` (`step`): attention's q/k/v norms with RoPE, the router, GeGLU and the
sampler's Philox numbers, one token per pass. `bf16.c` (`bf16`): the projections and experts
for bf16 operands (a `--dtype bfloat16` model), AVX512-BF16 or AMX where the CPU has them.
Exact numerics never use them; grad mode and other operands (bf16 ones outside the
projections and experts, fp16) fall back to the twins per call.

Threads: a kernel's rows are split into `torch.get_num_threads()` ranges run by torch's own
OpenMP team (`parallel.h`): a library built with -fopenmp needs libgomp.so.1, which is torch's,
already loaded, so no second runtime starts (`build.one_openmp_runtime` checks; else the ranges
go to Python threads calling the kernels without the GIL: `threads.split_rows`).

Numerics: the kernels' `exp` is a polynomial (~1 ulp) and their sums run in another (fixed)
order, so their values differ from the twins' in the last bits; a sample differs only where u
falls within that rounding of a boundary between two tokens. Rows are independent and every
sum runs in the same order whatever a row's address, so a row's results never depend on its
batch (tested: `tests/kernels/test_native_cpu.py`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from kernels.kernel_set import KernelSet
from kernels.native import moe, onednn, step
from kernels.native.packing import PackedWeights


def bind_packed(kernels: KernelSet) -> KernelSet:
    """`kernels` for one model (`KernelSet.for_model`): the native kernels that pack weights
    (dense projections, experts, router) given a `PackedWeights` of this binding's own, so each
    weight is packed once for the model and its copy goes with the model's kernels; whether
    its bf16 dense projections run oneDNN on weights reordered once is decided here."""
    packs = PackedWeights(onednn=onednn.decide())
    packing = {
        "linear": moe.linear,
        "linear_many": moe.linear_many,
        "gated_linear": moe.gated_linear,
        "fused_moe": moe.fused_moe,
        "route_experts": step.route_experts,
    }
    bound: dict[str, Any] = {
        name: functools.partial(fn, packs=packs)
        for name, fn in packing.items()
        if getattr(kernels, name) is fn
    }
    return replace(kernels, **bound)
