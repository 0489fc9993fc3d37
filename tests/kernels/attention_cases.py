"""Paged canvas-attention scenarios and their inputs, shared by the attention kernel tests
(Triton, native, custom ops)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference


@dataclass(frozen=True, slots=True)
class Scenario:
    starts: tuple[int, ...]
    num_tokens: tuple[int, ...]
    decode: tuple[bool, ...]
    window: int = 0  # 0 = full layer
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    page_size: int = 4
    # (row, first, last) new-token indices of an image its tokens attend both ways (`span`)
    images: tuple[tuple[int, int, int], ...] = ()


SCENARIOS = {
    "decode-batch1-empty-prefix": Scenario((0,), (16,), (True,)),
    "encode-batch1-odd": Scenario((0,), (13,), (False,)),
    "mixed-full-page-crossing": Scenario((5, 9, 0), (7, 16, 3), (False, True, False)),
    # start = W - 1 (whole prefix visible), = W (first position drops out), > W (pages freed)
    "mixed-sliding-window-edge": Scenario(
        (5, 6, 13, 0), (9, 16, 17, 4), (False, True, False, True), window=6
    ),
    "gqa4-d32-page8": Scenario(
        (11, 3), (16, 5), (True, False), num_heads=8, head_dim=32, page_size=8
    ),  # fmt: skip
    "mha-sliding-encode-3-query-blocks": Scenario(
        (20,), (37,), (False,), window=5, num_heads=2, num_kv_heads=2
    ),
    "decode-sliding-long-prefix": Scenario((40,), (16,), (True,), window=7, num_kv_heads=1),
    # Rows of one length: the batched twin views the packed tokens instead of gathering them,
    # and drops the mask where every query sees every key (canvases over equal prefixes).
    "decode-uniform-same-prefix": Scenario((8, 8, 8), (16, 16, 16), (True, True, True)),
    "decode-uniform-ragged-prefix": Scenario((3, 8, 0), (16, 16, 16), (True, True, True)),
    "decode-uniform-sliding-past-window": Scenario(
        (9, 14, 20), (8, 8, 8), (True, True, True), window=6
    ),
    "encode-uniform-sliding": Scenario((4, 0, 9), (5, 5, 5), (False, False, False), window=6),
    # Only ENCODE rows (AR decoding, prefills): every key, new ones too, read from the pages.
    "encode-ragged-sliding": Scenario((4, 0, 9, 2), (3, 5, 1, 1), (False,) * 4, window=6),
    # Images attended both ways: across query blocks (16 under the interpreter), at a row's
    # start and end, next to a canvas; on sliding layers longer than the window.
    "images-full-mixed": Scenario(
        (5, 9, 0), (23, 16, 20), (False, True, False), images=((0, 2, 9), (0, 12, 22), (2, 0, 19))
    ),
    "images-sliding-longer-than-window": Scenario(
        (9, 14, 0), (30, 8, 21), (False, True, False), window=6, images=((0, 3, 24), (2, 1, 18))
    ),
    "images-uniform-encode-sliding": Scenario(
        (4, 0), (20, 20), (False, False), window=6, images=((0, 0, 19), (1, 5, 9))
    ),
}


@dataclass(frozen=True, slots=True)
class Inputs:
    q: torch.Tensor  # [N, Hq, D] (a transposed view: not contiguous)
    k: torch.Tensor  # [N, Hkv, D] (a slice of a packed kv tensor: not contiguous)
    v: torch.Tensor
    k_pool: torch.Tensor  # [P, Hkv, page, D]; pages no row reads hold NaN
    v_pool: torch.Tensor
    tables: list[list[int]]  # per row; -1 = page released (below the sliding window)
    rows: reference.PagedRows


def make_inputs(sc: Scenario, device: torch.device, dtype: torch.dtype = torch.float32) -> Inputs:
    gen = torch.Generator().manual_seed(sum(sc.starts) * 31 + sum(sc.num_tokens))
    size, n = sc.page_size, sum(sc.num_tokens)
    counts = [-(-(s + t) // size) for s, t in zip(sc.starts, sc.num_tokens, strict=True)]
    num_pages = sum(counts) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()  # pages out of order
    tables, used = [], 0
    for start, count in zip(sc.starts, counts, strict=True):
        table = perm[used : used + count]
        used += count
        lo, _ = reference.prefix_range(start, sc.window)
        tables.append([-1 if (i + 1) * size <= lo else p for i, p in enumerate(table)])
    shape = (num_pages, sc.num_kv_heads, size, sc.head_dim)
    k_pool = torch.randn(shape, generator=gen).to(dtype)
    v_pool = torch.randn(shape, generator=gen).to(dtype)
    live = {p for t in tables for p in t if p >= 0}
    for p in set(range(num_pages)) - live:  # any read of these poisons the output
        k_pool[p] = float("nan")
        v_pool[p] = float("nan")
    q = torch.randn(sc.num_heads, n, sc.head_dim, generator=gen).to(dtype).transpose(0, 1)
    kv = torch.randn(n, 2 * sc.num_kv_heads, sc.head_dim, generator=gen).to(dtype)
    span = None
    if sc.images:
        span = [
            (s + i, s + i) for s, t in zip(sc.starts, sc.num_tokens, strict=True) for i in range(t)
        ]
        for row, first, last in sc.images:
            offset, start = sum(sc.num_tokens[:row]), sc.starts[row]
            span[offset + first : offset + last + 1] = [(start + first, start + last)] * (
                last - first + 1
            )
    rows = reference.PagedRows.build(
        list(sc.starts),
        list(sc.num_tokens),
        list(sc.decode),
        tables,
        device,
        None if span is None else torch.tensor(span),
    )
    return Inputs(
        q=q.to(device),
        k=kv[:, : sc.num_kv_heads].to(device),
        v=kv[:, sc.num_kv_heads :].to(device),
        k_pool=k_pool.to(device),
        v_pool=v_pool.to(device),
        tables=tables,
        rows=rows,
    )


def run(impl: object, x: Inputs, sc: Scenario) -> torch.Tensor:
    """Attention as the engine calls it: the ENCODE rows' new keys stored first (`write_kv`,
    into copies of the pools), which the batched twin then reads back with the prefix."""
    k_pool, v_pool = x.k_pool.clone(), x.v_pool.clone()
    impl.write_kv(x.k, x.v, k_pool, v_pool, x.rows)
    return impl.canvas_attention(x.q, x.k, x.v, k_pool, v_pool, x.rows, sc.window, 1.0)
