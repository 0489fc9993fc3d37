"""Whether a step's size changes which Triton kernels it launches, checked on a machine without a
GPU: each launcher of a serving step, at the real 26B-A4B shapes in bf16, is called at several
step sizes (an AR token, an odd prefill chunk, a canvas, several canvases) and must ask Triton
for the same compiled kernels at every size. Then, once the warm-up has compiled them
(`engine.device.warmup`), steady traffic compiles nothing new.

    python -m loadtest.gpu.specialisations      # a line per call site; exit 1 on a difference

Nothing compiles: within `loadtest.gpu.compile.compile_only` (a stand-in driver naming sm_90),
Triton's `knobs.runtime.jit_cache_hook` records the cache key (the specialisation: argument
types, `== 1` and divisibility by 16 of the integers not in `do_not_specialize`, constexprs,
options) each launch would compile, and declines the compile. Run it in its own process with
TRITON_INTERPRET unset (the kernels must be defined for compilation).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from loadtest.gpu.compile import compile_only
from loadtest.gpu.compile_variants import (
    BF16,
    CANVAS,
    REAL,
    accept,
    attention,
    moe,
    norm,
    norm_rope,
    philox,
    sampler,
    softcap,
    tails,
)

# Tokens of a step: an AR token, an odd prefill chunk, a canvas, four canvases.
SIZES = (1, 37, CANVAS, 4 * CANVAS)
Site = Callable[[int], Callable[[], object]]  # step tokens -> the launcher call at that size


def keys_of(launch: Callable[[], object], arch: int = 90) -> dict[str, set[str]]:
    """The cache key of each kernel `launch` asks Triton for, by kernel name; compiles
    nothing."""
    from triton import knobs

    keys: dict[str, set[str]] = defaultdict(set)

    def declined(*, key: Any, fn: Any, **_: Any) -> bool:
        keys[fn.name].add(str(key))
        return True  # skip the compile

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = declined
    try:
        with compile_only(arch, []):
            launch()
    finally:
        knobs.runtime.jit_cache_hook = previous
    return dict(keys)


def size_dependent(sites: dict[str, Site], sizes: tuple[int, ...] = SIZES) -> list[str]:
    """What differs between sizes, in words: for each call site, each size whose kernels
    (names and keys) are not those of the first size; [] when none does."""
    found = []
    for name, site in sites.items():
        first = keys_of(site(sizes[0]))
        assert first, f"{name} launched no Triton kernel"
        for size in sizes[1:]:
            keys = keys_of(site(size))
            for kernel in sorted(set(first) | set(keys)):
                if keys.get(kernel) != first.get(kernel):
                    found.append(
                        f"{name}: {kernel} at {size} tokens is not the kernel compiled at "
                        f"{sizes[0]} ({len(keys.get(kernel, ()))} against "
                        f"{len(first.get(kernel, ()))} specialisations)"
                    )
    return found


def serving_sites() -> dict[str, Site]:
    """Every launcher of a serving step at the real shapes, by a step's token count n: rows of
    n tokens (prefill chunks, AR tokens), or max(1, n // 64) canvases."""
    d, kv, heads = REAL["head_dim"], REAL["num_key_value_heads"], REAL["num_attention_heads"]
    d_full, kv_full = REAL["global_head_dim"], REAL["num_global_key_value_heads"]
    window, vocab, hidden = REAL["sliding_window"], REAL["vocab_size"], REAL["hidden_size"]

    def canvases(n: int) -> dict[str, tuple[int, ...]]:
        rows = max(1, n // 64)  # prefixes of other lengths: page tables of other widths
        return {"prefixes": tuple(2048 + 37 * n * (i + 1) for i in range(rows)),
                "lengths": (CANVAS,) * rows}  # fmt: skip

    def chunk(n: int) -> dict[str, Any]:
        return {"prefixes": (3 * n,), "lengths": (n,), "decode": False}

    return {
        "attention sliding, canvases": lambda n: attention(d, kv, window, BF16, **canvases(n)),
        "attention full, canvases": lambda n: attention(d_full, kv_full, 0, BF16, **canvases(n)),
        "attention sliding, prefill": lambda n: attention(d, kv, window, BF16, **chunk(n)),
        "attention full, prefill": lambda n: attention(d_full, kv_full, 0, BF16, **chunk(n)),
        "write_kv": lambda n: attention(d, kv, window, BF16, write=True, **chunk(n)),
        "router": lambda n: moe(n, BF16),
        "experts": lambda n: moe(n, BF16, route=False),
        "rms_norm hidden": lambda n: norm((1, n, hidden), BF16),
        "rms_norm v heads": lambda n: norm((1, n, kv, d), BF16, weighted=False),
        "layer tails": lambda n: tails(n, hidden, REAL["intermediate_size"], BF16),
        "qkv_norm_rope sliding": lambda n: norm_rope(heads, kv, d, BF16, tokens=n),
        "qkv_norm_rope full": lambda n: norm_rope(16, kv_full, d_full, BF16, True, tokens=n),
        "softcap": lambda n: softcap(n, vocab, BF16),
        "sample_and_embed": lambda n: sampler(vocab, hidden, BF16, positions=n),
        "soft_embedding": lambda n: sampler(vocab, hidden, BF16, positions=n, fused=False),
        "entropy_accept": lambda n: accept(CANVAS, rows=max(1, n // 64)),
        "philox": lambda n: philox(max(1, n // 64), CANVAS),
        "philox, one per row": lambda n: philox(n, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.gpu.specialisations", description=__doc__.split("\n\n")[0]
    )
    p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the kernels must be defined for compilation")
    sites = serving_sites()
    found = size_dependent(sites)
    for line in found:
        print("PROBLEM:", line)
    sizes = ", ".join(map(str, SIZES))
    print(f"{len(sites)} call sites at {sizes} tokens: {len(found)} size-dependent kernels")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
