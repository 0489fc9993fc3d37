"""Deliberately broken Triton kernels, each with a launcher, for the tests of the compile check
(`loadtest.gpu.compile`). `python -m tests.kernels.bad_kernels` (TRITON_INTERPRET unset)
compiles them for sm_90 and prints the check's findings as JSON lines."""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _retyped_accumulator_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Runs under the interpreter; the compiler rejects the loop-carried type change."""
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        acc = acc + tl.load(x_ptr + start + i, mask=start + i < n, other=0.0)
    tl.store(out_ptr + i, acc)


@triton.jit
def _tile_kernel(a_ptr, b_ptr, out_ptr, k_dim, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):  # fmt: skip
    """out[BM, BN] = a[BM, K] @ b[K, BN], pipelined over K: shared memory grows with the tiles
    and the stages, registers with BM * BN / threads."""
    m, n = tl.arange(0, BM), tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, k_dim, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + m[:, None] * k_dim + k[None, :])
        b = tl.load(b_ptr + k[:, None] * BN + n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + m[:, None] * BN + n[None, :], acc)


@triton.jit
def _counted_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sums n elements; n is specialised (== 1, divisible by 16): a kernel per kind of count."""
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(x_ptr + start + i, mask=start + i < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, 0))


def counted(n: int) -> torch.Tensor:
    out = torch.empty(1)
    _counted_kernel[(1,)](torch.empty(n), out, n, BLOCK=16)
    return out


def retyped_accumulator() -> torch.Tensor:
    x, out = torch.arange(40, dtype=torch.float32), torch.zeros(16, dtype=torch.int32)
    _retyped_accumulator_kernel[(1,)](x, out, 40, BLOCK=16)
    return out


def tiles(bm: int, bn: int, bk: int, num_warps: int, num_stages: int) -> torch.Tensor:
    a = torch.empty(bm, 4 * bk, dtype=torch.bfloat16)
    b = torch.empty(4 * bk, bn, dtype=torch.bfloat16)
    out = torch.empty(bm, bn)
    _tile_kernel[(1,)](
        a, b, out, 4 * bk, BM=bm, BN=bn, BK=bk, num_warps=num_warps, num_stages=num_stages
    )
    return out


def main() -> int:
    from loadtest.gpu.compile import Variant, check

    variants = [
        Variant("retyped accumulator", "bad", retyped_accumulator),
        Variant("tiles too large for shared memory", "bad", lambda: tiles(128, 128, 128, 8, 4)),
        Variant("accumulator too large for registers", "bad", lambda: tiles(64, 128, 16, 1, 1)),
    ]
    compiled, found = check(variants, [90])
    for c in compiled:
        print(json.dumps({"variant": c.variant, "shared": c.shared, "stack": c.stack}))
    for line in found:
        print(json.dumps({"problem": line}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
