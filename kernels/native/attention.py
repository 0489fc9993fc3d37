"""Native CPU canvas attention over the paged KV cache (`attention.c`), bound by the native
backend (`kernels.backends.NativeBackend`).

The twin (`reference.canvas_attention`) gathers every row's prefix keys from their pages into
a padded [R, Hkv, S, D] tensor, concatenates the rows' new keys, builds a boolean mask over the
padding, the window and (ENCODE rows) causality, and calls SDPA: at small canvas steps those
gathers and masks cost a large fraction of SDPA itself, and a prompt chunk pays for every key
after its queries. The C kernel reads each row's keys
from their pages into a packed block per work item (one row, one KV head, up to QUERY_BLOCK of
its queries with all the head's query heads), takes the scores and the values' product as
register-tiled products, and runs each query's softmax over the keys it may see only. Rows with
image spans (bidirectional within an image), head dims that are not whole vector blocks, very
long rows and autograd keep the twin. bf16 q, k, v and pools (a `--dtype bfloat16` model's
cache) run the scores and the values' product on AMX tiles where `bf16.path` is amx (bf16 rows
as they are, fp32 sums, each softmax weight rounded to bf16 for the values' product), else are
read into fp32 row by row; the output rounded to bf16 either way.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

import kernels.native.bf16 as bf16
import kernels.reference as reference
from kernels.native.args import AttentionArgs
from kernels.native.build import library, loaded, on_torch_team
from kernels.native.threads import addresses, over_rows, scratch, takes
from kernels.reference_attention import PagedRows

# Queries of a row per work item (with all query heads of a KV head: 64 score rows at
# DiffusionGemma's grouping of 2): a canvas of 32 is one item per KV head.
QUERY_BLOCK = 32
# Keys per item beyond which the twin runs (a thread's scratch holds an item's keys, values
# and scores: ~3 MiB at 4,096 keys of 128 dims).
MAX_KEYS = 4096


def canvas_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: PagedRows,
    window: int,
    scale: float,
) -> torch.Tensor:
    """`reference.canvas_attention` (same arguments, same values up to rounding) by
    `attention.c`, where it applies (module docstring); the twin otherwise."""
    lanes = attention_lanes()
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    keys = rows.max_prefix(window) + rows.max_tokens
    if (
        rows.span is not None
        or not _shaped(q, k, v, k_pool, v_pool)
        or lanes == 0
        or dim % (2 * lanes)
        or heads % kv_heads
        or keys > MAX_KEYS
        or not (takes(q, k, v, k_pool, v_pool) or bf16.takes(q, k, v, k_pool, v_pool))
        or rows.start.device.type != "cpu"
    ):
        return reference.canvas_attention(q, k, v, k_pool, v_pool, rows, window, scale)
    lib = loaded("attention")
    items = _items(rows, kv_heads)
    longest = -(-keys // (2 * lanes)) * 2 * lanes
    groups = heads // kv_heads  # per thread: attention.c's kp, vp, scores and ATTN_EXTRA
    per_thread = longest * (2 * dim + groups * QUERY_BLOCK) + dim * (groups * QUERY_BLOCK + 19)
    tensors = (q, k, v, k_pool, v_pool)
    q, k, v, k_pool, v_pool = (t if t.is_contiguous() else t.contiguous() for t in tensors)
    out = torch.empty_like(q)
    args = AttentionArgs(
        **addresses(q=q, k=k, v=v, k_pool=k_pool, v_pool=v_pool, items=items, out=out),
        **addresses(start=rows.start, offset=rows.offset, count=rows.num_tokens),
        **addresses(decode=rows.decode, page_table=rows.page_table),
    )
    args.max_pages, args.hq, args.hkv, args.d = rows.page_table.shape[1], heads, kv_heads, dim
    args.size, args.window, args.qblock = k_pool.shape[2], window, QUERY_BLOCK
    args.scale, args.lmax, args.bf = scale, longest, _bf_mode(q)
    num_items = items.shape[0]
    if on_torch_team("attention"):
        team = min(torch.get_num_threads(), num_items)
        buffer = scratch(team * per_thread)
        args.scratch, args.begin, args.end, args.threads = buffer.data_ptr(), 0, num_items, team
        lib.canvas_attention(args)
    else:

        def run(begin: int, end: int) -> None:
            buffer = torch.empty(per_thread, dtype=torch.float32)
            part = AttentionArgs.from_buffer_copy(args)
            part.scratch, part.begin, part.end, part.threads = buffer.data_ptr(), begin, end, 1
            lib.canvas_attention(part)

        over_rows(run, num_items, 1)
    return out


def _shaped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
) -> bool:
    """Whether the operands agree as the C kernel indexes them (else the twin, which refuses
    what does not fit): q [N, Hq, D], k and v [N, Hkv, D], pools [P, Hkv, page, D]."""
    return (
        q.dim() == k.dim() == 3
        and k.shape == v.shape
        and k_pool.shape == v_pool.shape
        and k_pool.dim() == 4
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2] == k_pool.shape[3]
        and k.shape[1] == k_pool.shape[1]
    )


def _items(rows: PagedRows, kv_heads: int) -> torch.Tensor:
    """[num_items, 3] int64 (row, KV head, first query) of every work item, built once per
    forward (`rows.memo`; every layer of the forward has the same rows), in NumPy (cheaper
    than a dozen small torch ops)."""
    key = ("native_attention_items", kv_heads)
    items = rows.memo.get(key)
    if items is None:
        blocks = (rows.num_tokens.numpy().astype(np.int64) + QUERY_BLOCK - 1) // QUERY_BLOCK
        row = np.repeat(np.arange(blocks.shape[0], dtype=np.int64), blocks)
        first = np.arange(row.shape[0], dtype=np.int64) - np.repeat(
            np.cumsum(blocks) - blocks, blocks
        )
        table = np.empty((row.shape[0], kv_heads, 3), dtype=np.int64)
        table[..., 0] = row[:, None]
        table[..., 1] = np.arange(kv_heads, dtype=np.int64)
        table[..., 2] = (first * QUERY_BLOCK)[:, None]
        items = rows.memo[key] = torch.from_numpy(table.reshape(-1, 3))
    assert isinstance(items, torch.Tensor)
    return items


@functools.cache
def attention_lanes() -> int:
    """The vector width (floats) `attention.c` was compiled with; 0 without the library."""
    lib = library("attention")
    return int(lib.canvas_attention_lanes()) if lib is not None else 0


def _bf_mode(q: torch.Tensor) -> int:
    """attention.c's `bf`: 0 fp32; 1 bf16 read into fp32; 2 bf16 on AMX tiles (`bf16.path`
    amx: the kernel takes them where D is a multiple of 32)."""
    if q.dtype is not torch.bfloat16:
        return 0
    return 2 if bf16.path() == bf16.PATHS["amx"] else 1
