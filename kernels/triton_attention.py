"""Canvas attention and the paged KV write, in Triton. Twins: `reference.canvas_attention`,
`reference.write_kv` (same signatures, same contracts).

One program handles one (row, block of the row's queries, query head). It streams the row's
cached prefix keys straight out of the paged pools (through the page table, never gathered into
a copy), then the row's new keys from the packed k/v, with an online softmax (FlashAttention-2).
DECODE rows see every key of their range; ENCODE rows are causal and, on sliding layers, see a
key at position p from a query at position q iff p > q - window; with `rows.span`, an ENCODE
query also sees the new keys of its span (its image's tokens, both ways). Key blocks that no
query of the program can see are skipped, so an ENCODE row's cost grows with the window, not
the prefix. Without spans (`HAS_SPAN` false) the span code is compiled out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import PagedRows
from kernels.support import dot_precision, expect, interpreting

_LOG2E = 1.4426950408889634
# The rows' metadata: `PagedRows.build` packs it into one tensor, so where a column starts
# depends on the step's row count. Read a scalar per row (and page ids one at a time), it gains
# nothing from 16-byte alignment, and specialising on it would compile a kernel per row count.
_ROW_METADATA = ["start_ptr", "offset_ptr", "ntok_ptr", "decode_ptr", "table_ptr"]


@triton.jit
def _online_update(s, vis, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    """One key block of the online softmax: s [BM, BN] scores in log2 units, v [BN, D]."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _query_spans(span_ptr, offset, start, t, t_mask, num_tokens):
    """Each query's span as key indices within its row, [first, last] (padding: empty)."""
    first = tl.load(span_ptr + (offset + t) * 2, mask=t_mask, other=0) - start
    last = tl.load(span_ptr + (offset + t) * 2 + 1, mask=t_mask, other=0) - start
    return tl.where(t_mask, first, num_tokens), tl.where(t_mask, last, -1)


@triton.jit
def _new_kv(k_ptr, v_ptr, n, n_mask, kv_head, d, sk_n, sk_h, sv_n, sv_h):
    """A block of new keys, transposed ([D, BN]), and its values ([BN, D]) from packed k, v."""
    kt = tl.load(
        k_ptr + n[None, :] * sk_n + kv_head * sk_h + d[:, None], mask=n_mask[None, :], other=0.0
    )
    vb = tl.load(
        v_ptr + n[:, None] * sv_n + kv_head * sv_h + d[None, :], mask=n_mask[:, None], other=0.0
    )
    return kt, vb


@triton.jit(do_not_specialize=["st_r"], do_not_specialize_on_alignment=[*_ROW_METADATA, "span_ptr"])
def _canvas_attention_kernel(
    q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, out_ptr,
    start_ptr, offset_ptr, ntok_ptr, decode_ptr, table_ptr, span_ptr,
    sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h,
    skp_p, skp_h, skp_s, svp_p, svp_h, svp_s, st_r,
    qk_scale, window,
    GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SPAN: tl.constexpr,
):  # fmt: skip
    row, q_block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_tokens = tl.load(ntok_ptr + row)
    if q_block * BLOCK_M >= num_tokens:
        return
    start = tl.load(start_ptr + row)
    offset = tl.load(offset_ptr + row)
    decode = tl.load(decode_ptr + row) != 0
    kv_head = head // GROUP
    t = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the row
    t_mask = t < num_tokens
    q_pos = start + t
    d = tl.arange(0, D)
    q_offsets = (offset + t)[:, None] * sq_n + head * sq_h + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=t_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    windowed = (window > 0) & (decode == 0)  # per-query window (ENCODE rows, sliding layers)
    first_q = start + q_block * BLOCK_M

    # Cached prefix: positions [lo, start), read through the page table.
    lo = tl.where(window > 0, tl.maximum(start - (window - 1), 0), 0)
    # Older keys are outside the window of every query of this program.
    lo = tl.where(windowed, tl.maximum(lo, first_q - window + 1), lo)
    for kb in range(lo, start, BLOCK_N):
        p = kb + tl.arange(0, BLOCK_N)
        p_mask = p < start
        # int64: page * page stride overflows int32 in pools past 2**31 elements.
        page = tl.load(table_ptr + row * st_r + p // PAGE, mask=p_mask, other=0).to(tl.int64)
        slot = p % PAGE
        kt = tl.load(
            kp_ptr + page[None, :] * skp_p + kv_head * skp_h + slot[None, :] * skp_s + d[:, None],
            mask=p_mask[None, :],
            other=0.0,
        )
        vb = tl.load(
            vp_ptr + page[:, None] * svp_p + kv_head * svp_h + slot[:, None] * svp_s + d[None, :],
            mask=p_mask[:, None],
            other=0.0,
        )
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        vis = p_mask[None, :] & ((p[None, :] > q_pos[:, None] - window) | (windowed == 0))
        m_i, l_i, acc = _online_update(s, vis, m_i, l_i, acc, vb, PRECISION)

    # The row's own new keys: all of them (DECODE), or causal and windowed (ENCODE).
    new_hi = tl.where(decode, num_tokens, tl.minimum(num_tokens, (q_block + 1) * BLOCK_M))
    new_lo = tl.where(windowed, tl.maximum(q_block * BLOCK_M - window + 1, 0), 0)
    if HAS_SPAN:  # each query's span of new keys (its image), both ways
        span_first, span_last = _query_spans(span_ptr, offset, start, t, t_mask, num_tokens)
        new_hi = tl.where(decode, new_hi, tl.maximum(new_hi, tl.max(span_last, 0) + 1))
        new_lo = tl.minimum(new_lo, tl.maximum(tl.min(span_first, 0), 0))
    for kb in range(new_lo, new_hi, BLOCK_N):
        j = kb + tl.arange(0, BLOCK_N)
        j_mask = j < num_tokens
        kt, vb = _new_kv(k_ptr, v_ptr, offset + j, j_mask, kv_head, d, sk_n, sk_h, sv_n, sv_h)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        causal = (j[None, :] <= t[:, None]) & ((j[None, :] > t[:, None] - window) | (window == 0))
        if HAS_SPAN:
            causal |= (j[None, :] >= span_first[:, None]) & (j[None, :] <= span_last[:, None])
        vis = j_mask[None, :] & (causal | decode)
        m_i, l_i, acc = _online_update(s, vis, m_i, l_i, acc, vb, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i = 0 only on padding queries
    out_offsets = (offset + t)[:, None] * so_n + head * so_h + d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None])


@triton.jit(do_not_specialize=["st_r"], do_not_specialize_on_alignment=_ROW_METADATA)
def _write_kv_kernel(
    k_ptr, v_ptr, kp_ptr, vp_ptr,
    start_ptr, offset_ptr, ntok_ptr, decode_ptr, table_ptr,
    sk_n, sk_h, sv_n, sv_h, skp_p, skp_h, skp_s, svp_p, svp_h, svp_s, st_r,
    PAGE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    row, t_block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_tokens = tl.load(ntok_ptr + row)
    if (tl.load(decode_ptr + row) != 0) | (t_block * BLOCK_T >= num_tokens):
        return
    start = tl.load(start_ptr + row)
    offset = tl.load(offset_ptr + row)
    t = t_block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    pos = start + t
    page = tl.load(table_ptr + row * st_r + pos // PAGE, mask=t_mask, other=0).to(tl.int64)
    slot = pos % PAGE
    d = tl.arange(0, D)
    mask = t_mask[:, None]
    k = tl.load(k_ptr + (offset + t)[:, None] * sk_n + head * sk_h + d[None, :], mask=mask)
    v = tl.load(v_ptr + (offset + t)[:, None] * sv_n + head * sv_h + d[None, :], mask=mask)
    kp = kp_ptr + page[:, None] * skp_p + head * skp_h + slot[:, None] * skp_s + d[None, :]
    vp = vp_ptr + page[:, None] * svp_p + head * svp_h + slot[:, None] * svp_s + d[None, :]
    tl.store(kp, k, mask=mask)
    tl.store(vp, v, mask=mask)


def _blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps). The interpreter gets the smallest tiles tl.dot allows, so
    that tests cross several key blocks; GPU sizes keep Q, K, V tiles and the accumulator within
    the register/shared budget at head_dim 256 and 512 (not yet tuned on hardware)."""
    if interpreting():
        return 16, 16, 4
    if head_dim <= 128:
        return 64, 64, 4
    if head_dim <= 256:
        return 64, 32, 8
    return 32, 32, 8


def _check_rows(rows: PagedRows, num_tokens: int, device: torch.device) -> None:
    num_rows = rows.start.shape[0]
    for name in ("start", "offset", "num_tokens", "decode"):
        expect(getattr(rows, name), f"rows.{name}", (num_rows,), (torch.int32,), device)
    expect(rows.page_table, "rows.page_table", (num_rows, None), (torch.int32,), device)
    assert rows.page_table.is_contiguous(), "rows.page_table must be contiguous"
    assert rows.max_tokens <= num_tokens, "rows.max_tokens exceeds the packed token count"


def _check_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
) -> tuple[int, int, int]:
    """Shapes shared by both launchers; returns (num_tokens, num_kv_heads, head_dim)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    expect(k, "k", (num_tokens, num_kv_heads, head_dim), dtypes, k.device)
    expect(v, "v", tuple(k.shape), (k.dtype,), k.device)
    pool_shape = (None, num_kv_heads, None, head_dim)
    expect(k_pool, "k_pool", pool_shape, (k.dtype,), k.device)
    expect(v_pool, "v_pool", tuple(k_pool.shape), (k.dtype,), k.device)
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim: a power of two >= 16"
    return num_tokens, num_kv_heads, head_dim


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
    """See `reference.canvas_attention`. Returns a new contiguous [N, Hq, D] tensor."""
    num_tokens, num_kv_heads, head_dim = _check_kv(k, v, k_pool, v_pool)
    num_heads = q.shape[1]
    expect(q, "q", (num_tokens, num_heads, head_dim), (k.dtype,), k.device)
    assert num_heads % num_kv_heads == 0, "q heads must be a multiple of kv heads"
    assert window >= 0, "window: 0 (full layer) or the sliding window"
    _check_rows(rows, num_tokens, q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    span = rows.span
    if span is not None:
        expect(span, "rows.span", (num_tokens, 2), (torch.int32,), q.device)
        assert span.is_contiguous(), "rows.span must be contiguous"
    block_m, block_n, num_warps = _blocks(head_dim)
    grid = (rows.start.shape[0], triton.cdiv(rows.max_tokens, block_m), num_heads)
    _canvas_attention_kernel[grid](
        q, k, v, k_pool, v_pool, out,
        rows.start, rows.offset, rows.num_tokens, rows.decode, rows.page_table,
        rows.start if span is None else span,  # never read without spans
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), rows.page_table.stride(0),
        scale * _LOG2E, window,
        GROUP=num_heads // num_kv_heads, PAGE=k_pool.shape[2], D=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        HAS_SPAN=span is not None, num_warps=num_warps,
    )  # fmt: skip
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows
) -> None:
    """See `reference.write_kv`: ENCODE rows' new k, v into their pages, in place."""
    num_tokens, num_kv_heads, head_dim = _check_kv(k, v, k_pool, v_pool)
    _check_rows(rows, num_tokens, k.device)
    if num_tokens == 0 or rows.all_decode:  # DECODE rows write no KV: nothing to launch
        return
    block_t = 16
    grid = (rows.start.shape[0], triton.cdiv(rows.max_tokens, block_t), num_kv_heads)
    _write_kv_kernel[grid](
        k, v, k_pool, v_pool,
        rows.start, rows.offset, rows.num_tokens, rows.decode, rows.page_table,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), rows.page_table.stride(0),
        PAGE=k_pool.shape[2], D=head_dim, BLOCK_T=block_t,
    )  # fmt: skip


KERNELS = (canvas_attention, write_kv)
