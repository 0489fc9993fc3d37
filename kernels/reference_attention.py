"""PyTorch twins of canvas attention over a paged prefix and of the paged KV write (part of
`kernels.reference`'s namespace; the Triton versions are in `kernels.triton_attention`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention with grouped KV heads.

    q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: bool [B, 1, T, S] (True = attend) or None
    (every query sees every key). Returns [B, Hq, T, D].
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


@dataclass(frozen=True, slots=True)
class PagedRows:
    """The rows of one forward pass as the attention kernels see them (one pool's page tables).

    Tensors are int32 on the device of the pools, one entry per row: `start` (prefix length =
    position of the first new token), `offset` (packed index of the row's first new token),
    `num_tokens`, `decode` (1 = DECODE row: bidirectional canvas, writes nothing; 0 = ENCODE row:
    causal, writes its KV) and `page_table` [R, max_pages] (-1 = no page). `max_tokens` is the
    largest `num_tokens`, kept on the host so that launchers never wait for the device.

    `span` (None: every ENCODE row is plain causal, and nothing is spent on spans): [N, 2] int32,
    for each packed new token the (first, last) positions of the keys it also sees both ways —
    its image's tokens on a checkpoint that attends within images bidirectionally, (pos, pos)
    for a text token. An ENCODE query at q then sees a key at p iff it would causally (p <= q,
    and p > q - window on sliding layers) or first <= p <= last: the reference's
    `or_masks(causal, blockwise_overlay)`. A span lies within its row's new tokens
    (first >= start; the scheduler never splits an image across passes). DECODE rows ignore it.
    """

    start: torch.Tensor  # [R] int32
    offset: torch.Tensor  # [R] int32
    num_tokens: torch.Tensor  # [R] int32
    decode: torch.Tensor  # [R] int32
    page_table: torch.Tensor  # [R, max_pages] int32
    max_tokens: int
    max_start: int = 0  # the largest `start`, on the host (bounds a row's prefix range)
    # Every row has `max_tokens` new tokens (so row r's tokens are packed at r * max_tokens):
    # the twins then view the packed tokens as [R, T] instead of gathering them.
    uniform: bool = False
    min_start: int = 0  # the smallest `start`, on the host
    all_decode: bool = False  # every row is a DECODE row (bidirectional), on the host
    no_decode: bool = False  # every row is an ENCODE row (writes its KV first), on the host
    span: torch.Tensor | None = None  # [N, 2] int32 (first, last) seen both ways; None: causal
    # What the twins derive from these rows once per forward and reuse in every layer of the
    # pool (index tensors and masks, keyed by window); never read by the Triton kernels.
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False)

    def max_prefix(self, window: int) -> int:
        """The longest prefix range any row reads on a layer with this window (0 = full)."""
        return min(self.max_start, window - 1) if window > 0 else self.max_start

    @staticmethod
    def build(
        starts: list[int],
        num_tokens: list[int],
        decode: list[bool],
        page_tables: list[list[int]] | torch.Tensor,
        device: torch.device | str = "cpu",
        span: torch.Tensor | None = None,
        stage: Callable[[np.ndarray], torch.Tensor] | None = None,
    ) -> PagedRows:
        """Pack per-row Python lists (as the engine's rows hold them) into device tensors;
        `page_tables`: each row's list, or the [R, max_pages] int32 table already on `device`
        (the engine's device page tables); `span`: [N, 2] (first, last) of each packed new
        token on the host, or None (class docstring); `stage`: moves a host array to `device`
        without waiting (the engine's `engine.device.cuda.to_device`), or None: pinned here
        for a GPU."""
        offsets = [0, *itertools.accumulate(num_tokens[:-1])]
        table: list[int] = []
        if not isinstance(page_tables, torch.Tensor):
            width = max(1, max(len(t) for t in page_tables))
            table = [p for t in page_tables for p in (*t, *[-1] * (width - len(t)))]
        # One host tensor of every column, moved in one copy that does not wait (five blocking
        # `torch.tensor(..., device=)` copies were five host syncs per pool kind on a GPU); made
        # by numpy, faster than `torch.tensor` from a list; pinned for a GPU, where a copy from
        # pageable memory may wait for the stream.
        columns = [*starts, *offsets, *num_tokens, *map(int, decode), *table]
        move = stage or (lambda array: _pinned_copy(array, device))
        packed = move(np.array(columns, dtype=np.int32))
        num_rows = len(starts)
        start, offset, count, flags, pages = packed.split([num_rows] * 4 + [len(table)])
        if isinstance(page_tables, torch.Tensor):
            pages = page_tables
        if span is not None:
            span = move(span.to(torch.int32).contiguous().numpy())
        return PagedRows(
            start=start,
            offset=offset,
            num_tokens=count,
            decode=flags,
            page_table=pages.view(num_rows, -1),
            max_tokens=max(num_tokens),
            max_start=max(starts),
            uniform=min(num_tokens) == max(num_tokens),
            min_start=min(starts),
            all_decode=all(decode),
            no_decode=not any(decode),
            span=span,
        )


def _pinned_copy(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """`array` on `device` by a copy that does not wait: from pinned memory for a GPU."""
    host = torch.from_numpy(array)
    cuda = torch.device(device).type == "cuda"
    return (host.pin_memory() if cuda else host).to(device, non_blocking=True)


def prefix_range(start: int, window: int) -> tuple[int, int]:
    """[lo, hi) of cached prefix positions a row reads: the last `window - 1` positions on a
    sliding layer (`window` > 0), all of them on a full layer (`window` = 0)."""
    return (max(0, start - (window - 1)) if window > 0 else 0), start


def _host_rows(rows: PagedRows) -> list[tuple[int, int, int, int, list[int]]]:
    """(start, offset, num_tokens, decode, page table) of every row, as Python values."""
    columns = [t.tolist() for t in (rows.start, rows.offset, rows.num_tokens, rows.decode)]
    return list(zip(*columns, rows.page_table.tolist(), strict=True))


def gather_pages(pool: torch.Tensor, pages: list[int], lo: int, hi: int) -> torch.Tensor:
    """Positions [lo, hi) of a row from pool [P, Hkv, page, D] -> [Hkv, hi - lo, D]."""
    size = pool.shape[2]
    if hi <= lo:
        return pool.new_zeros(pool.shape[1], 0, pool.shape[3])
    index = torch.tensor(pages[lo // size : -(-hi // size)], device=pool.device)
    flat = pool.index_select(0, index).transpose(0, 1).flatten(1, 2)  # [Hkv, n*page, D]
    base = (lo // size) * size
    return flat[:, lo - base : hi - base]


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
    """Attention of every row's new tokens over its cached prefix and its own new tokens.

    q: [N, Hq, D]; k, v: [N, Hkv, D] (the packed new tokens of all rows, Hq a multiple of Hkv);
    pools: [num_pages, Hkv, page_size, D], read-only here, holding the ENCODE rows'
    new keys already (`write_kv`). A row reads its prefix range
    (`prefix_range(start, window)`), then its new keys: all of them for a DECODE row; for an
    ENCODE row a key at position p is visible to a query at position q iff p <= q and (sliding
    layers) p > q - window. Returns [N, Hq, D].

    All rows in one attention call: rows are padded to the longest prefix range and the longest
    row, every row's keys gathered from its pages by one row copy per key and head, and a
    boolean mask hides the padding (tensor ops only, no loop over rows). The index tensors and
    the mask depend only on the rows and the window, so they are built once per forward
    (`rows.memo`) and reused by every layer; rows of equal length are viewed, not gathered.
    When every row is an ENCODE row, its new keys are read from the pool as well (the engine
    calls `write_kv` first, so they are there): one gather, nothing concatenated.
    """
    if not (rows.all_decode or rows.no_decode) and rows.start.device.type == "cpu":
        return _by_kind(q, k, v, k_pool, v_pool, rows, window, scale)
    size = k_pool.shape[2]
    key = ("canvas_attention", window, size, k_pool.shape[1])
    plan = rows.memo.get(key)
    if plan is None:
        plan = rows.memo[key] = _AttentionPlan.build(
            rows, window, k_pool.shape[1], size, q.shape[0]
        )
    assert isinstance(plan, _AttentionPlan)
    if plan.gather is None:  # no prefix: the new keys alone
        keys, values = plan.pack(k).transpose(1, 2), plan.pack(v).transpose(1, 2)
    else:
        keys, values = plan.read(k_pool), plan.read(v_pool)  # [R, Hkv, S(+T), D]
        if plan.hide is not None:  # padding reads page 0: zero it (pages may hold NaN)
            keys.masked_fill_(plan.hide, 0.0)
            values.masked_fill_(plan.hide, 0.0)
        if not plan.from_pool:
            keys = torch.cat([keys, plan.pack(k).transpose(1, 2)], 2)
            values = torch.cat([values, plan.pack(v).transpose(1, 2)], 2)
    queries = plan.pack(q).transpose(1, 2)  # [R, Hq, T, D]
    out = attention(queries, keys, values, plan.visible, scale)
    return plan.unpack(out.transpose(1, 2))  # [N, Hq, D]


def _by_kind(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: PagedRows,
    window: int,
    scale: float,
) -> torch.Tensor:
    """`canvas_attention` of a mixed forward (CPU) as two calls, its DECODE rows and its ENCODE
    rows each padded among themselves: padded together, every canvas of 32 queries was padded to
    the longest prompt chunk's length (and every prompt to its prefix plus that), several
    times the arithmetic of a step that mixes prompts and canvases. Same values: every row's keys,
    mask and queries are its own either way."""
    split = rows.memo.get("by_kind")
    if split is None:
        split = rows.memo["by_kind"] = _split_rows(rows)
    out = torch.empty_like(q)
    for part, index in split:  # type: ignore[attr-defined]
        got = canvas_attention(
            q.index_select(0, index), k.index_select(0, index), v.index_select(0, index),
            k_pool, v_pool, part, window, scale,
        )  # fmt: skip
        out.index_copy_(0, index, got)
    return out


def _split_rows(rows: PagedRows) -> list[tuple[PagedRows, torch.Tensor]]:
    """(the DECODE rows, their packed token indices) and the same of the ENCODE rows, each
    packed on its own (host tensors: the CPU twin's; no Python loop over rows or tokens)."""
    per_token = torch.repeat_interleave(rows.decode, rows.num_tokens.long())
    parts = []
    for kind in (1, 0):
        chosen = (rows.decode == kind).nonzero()[:, 0]
        if not chosen.numel():  # e.g. a graph's capture over dummy rows only
            continue
        index = (per_token == kind).nonzero()[:, 0]
        count, start = rows.num_tokens[chosen], rows.start[chosen]
        part = PagedRows(
            start=start,
            offset=(count.cumsum(0) - count).to(torch.int32),
            num_tokens=count,
            decode=rows.decode[chosen],
            page_table=rows.page_table[chosen],
            max_tokens=int(count.max()),
            max_start=int(start.max()),
            uniform=bool(count.min() == count.max()),
            min_start=int(start.min()),
            all_decode=kind == 1,
            no_decode=kind == 0,
            span=None if rows.span is None else rows.span[index],
        )
        parts.append((part, index))
    return parts


@dataclass(frozen=True, slots=True)
class _AttentionPlan:
    """`canvas_attention`'s index tensors and mask for one set of rows, one window, one number
    of KV heads and one page size: built once per forward, used by every layer of the pool."""

    num_rows: int
    # [R * Hkv * S] row of the pool viewed as [P * Hkv * page, D] for each key a row reads, in
    # [R, Hkv, S] order (one row copy per key and head; None: no prefix)
    gather: torch.Tensor | None
    # the gathered keys are all of a row's keys, its new ones included (every row is an ENCODE
    # row, whose new keys `write_kv` has stored): nothing to concatenate
    from_pool: bool
    hide: torch.Tensor | None  # [R, 1, S, 1] padding among the prefix keys (None: none)
    token: torch.Tensor | None  # [R, T] packed index of each padded new token (None: uniform)
    unpad: tuple[torch.Tensor, torch.Tensor] | None  # (row, column) of each packed token
    visible: torch.Tensor | None  # [R, 1, T, S+T] the keys each query sees (None: all)

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        """The gathered keys (or values) of every row from pool [P, Hkv, page, D]:
        [R, Hkv, S, D], contiguous (SDPA's layout)."""
        assert self.gather is not None
        flat = pool.view(-1, pool.shape[-1]).index_select(0, self.gather)
        return flat.view(self.num_rows, pool.shape[1], -1, pool.shape[-1])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Packed [N, H, D] -> padded [R, T, H, D] (a view when the rows are uniform)."""
        if self.token is None:
            return x.view(self.num_rows, -1, *x.shape[1:])
        return x[self.token]

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """Padded [R, T, H, D] -> packed [N, H, D]."""
        if self.unpad is None:
            return out.reshape(-1, *out.shape[2:])
        return out[self.unpad]

    @staticmethod
    def build(rows: PagedRows, window: int, heads: int, size: int, num_new: int) -> _AttentionPlan:
        dev = rows.start.device
        num_rows = rows.start.shape[0]
        start, count = rows.start.long(), rows.num_tokens.long()
        lo = (start - (window - 1)).clamp(min=0) if window > 0 else torch.zeros_like(start)
        prefix_len = rows.max_prefix(window)
        prefix_pos = lo[:, None] + torch.arange(prefix_len, device=dev)  # [R, S]
        prefix_ok = prefix_pos < start[:, None]
        t = torch.arange(rows.max_tokens, device=dev)
        new_ok = t < count[:, None]  # [R, T]
        # No padding among the prefix keys: every row reads prefix_len of them.
        cap = window - 1 if window > 0 else rows.max_start
        padded_prefix = min(rows.min_start, cap) != prefix_len
        # Rows with a prefix and only ENCODE rows: read the new keys from the pool too.
        from_pool = bool(prefix_len) and rows.no_decode
        gather = hide = None
        if prefix_len:
            pos, ok = prefix_pos, prefix_ok
            if from_pool:
                pos = torch.cat([prefix_pos, start[:, None] + t], 1)
                ok = torch.cat([prefix_ok, new_ok], 1)
            # Padding keys read one of the row's own keys (masked out of the scores, and finite
            # unless the row's own values are not): its first prefix key, or for a row without
            # a prefix (an ENCODE row at 0) its first new key, written before attention. Only a
            # DECODE row at 0 has neither; then padding reads page 0 and is zeroed (any page
            # may hold NaN from an earlier request, and 0 x NaN would leak into the row).
            own = torch.where(start > 0, lo, start)[:, None]  # [R, 1]
            pos = torch.where(ok, pos, own)
            page = rows.page_table.long().gather(1, pos // size)
            if padded_prefix and bool(((start == 0) & rows.decode.bool()).any()):
                page = torch.where(ok, page, 0)
                hide = ~ok[:, None, :, None]
            head = torch.arange(heads, device=dev)[None, :, None]
            gather = ((page[:, None] * heads + head) * size + (pos % size)[:, None]).reshape(-1)
        token = unpad = None
        if not rows.uniform:
            token = torch.where(new_ok, rows.offset.long()[:, None] + t, 0)
            row = torch.repeat_interleave(
                torch.arange(num_rows, device=dev), count, output_size=num_new
            )
            unpad = (row, torch.arange(num_new, device=dev) - rows.offset.long()[row])
        visible = None
        if rows.no_decode and rows.max_tokens == 1:  # one query per row (AR): every key of the
            if padded_prefix:  # row is at or before it and inside its window: hide padding only
                visible = torch.cat([prefix_ok, new_ok], 1)[:, None, None, :]
        elif padded_prefix or not rows.uniform or not rows.all_decode:
            q_pos = (start[:, None] + t)[:, :, None]  # [R, T, 1]
            key_pos = torch.cat([prefix_pos, start[:, None] + t], 1)[:, None, :]  # [R, 1, S+T]
            key_ok = torch.cat([prefix_ok, new_ok], 1)[:, None, :]
            vis = key_pos <= q_pos
            if window > 0:
                vis &= key_pos > q_pos - window
            if rows.span is not None:  # and the keys of the query's image, both ways
                span = rows.span.long()
                if token is not None:
                    span = span[token]  # [R, T, 2]
                span = span.view(num_rows, -1, 2)
                vis |= (key_pos >= span[:, :, :1]) & (key_pos <= span[:, :, 1:])
            vis = key_ok & (vis | rows.decode.bool()[:, None, None])  # [R, T, S+T]
            # Padding queries see every real key (never an all-masked row: SDPA would give NaN).
            visible = torch.where(new_ok[:, :, None], vis, key_ok)[:, None]
        return _AttentionPlan(num_rows, gather, from_pool, hide, token, unpad, visible)


def canvas_attention_rowwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: PagedRows,
    window: int,
    scale: float,
) -> torch.Tensor:
    """`canvas_attention` one row at a time, each over exactly its own keys, in the
    transformers reference's operation order: exact numerics (bit-identical to the reference on
    CPU, batch invariant). Same contract as `canvas_attention`.

    q: [N, Hq, D]; k, v: [N, Hkv, D] (the packed new tokens of all rows, Hq a multiple of Hkv);
    pools: [num_pages, Hkv, page_size, D], read-only here. A row reads its prefix range
    (`prefix_range(start, window)`), then its new keys: all of them for a DECODE row; for an
    ENCODE row a key at position p is visible to a query at position q iff p <= q and (sliding
    layers) p > q - window, or p lies in the query's `rows.span` — the reference's mask
    exactly. Returns [N, Hq, D].
    """
    out = torch.empty_like(q)
    spans = None if rows.span is None else rows.span.cpu().long()  # [N, 2]
    for start, offset, n, decode, table in _host_rows(rows):
        lo, hi = prefix_range(start, window)
        new = slice(offset, offset + n)
        keys = torch.cat([gather_pages(k_pool, table, lo, hi), k[new].transpose(0, 1)], 1)
        values = torch.cat([gather_pages(v_pool, table, lo, hi), v[new].transpose(0, 1)], 1)
        mask = None
        if not decode:
            key_pos = torch.cat([torch.arange(lo, hi), torch.arange(start, start + n)])
            q_pos = torch.arange(start, start + n)[:, None]
            mask = key_pos[None, :] <= q_pos
            if window > 0:
                mask &= key_pos[None, :] > q_pos - window
            if spans is not None:
                first, last = spans[new].unbind(1)
                mask |= (key_pos[None, :] >= first[:, None]) & (key_pos[None, :] <= last[:, None])
            mask = mask[None, None].to(q.device)
        row_out = attention(q[new].transpose(0, 1)[None], keys[None], values[None], mask, scale)
        out[new] = row_out[0].transpose(0, 1)
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows
) -> None:
    """Store the new k, v ([N, Hkv, D]) of every ENCODE row at positions start.. of its pages
    (in place); DECODE rows write nothing. One indexed copy for all rows (values are copied,
    never computed, so this is exact in both numerics)."""
    num_new, heads, size = k.shape[0], k_pool.shape[1], k_pool.shape[2]
    if num_new == 0 or rows.all_decode:
        return
    key = ("write_kv", size, heads)
    where = rows.memo.get(key)  # the same for every layer of the pool: built once per forward
    if where is None:
        row = torch.repeat_interleave(
            torch.arange(rows.start.shape[0], device=k.device),
            rows.num_tokens.long(),
            output_size=num_new,
        )  # [N] row of each packed token
        pos = rows.start.long()[row] + torch.arange(num_new, device=k.device)
        pos -= rows.offset.long()[row]
        keep = None if rows.no_decode else (rows.decode[row] == 0).nonzero()[:, 0]
        if keep is not None:
            row, pos = row[keep], pos[keep]
        page = rows.page_table.long()[row, pos // size]
        # One row of the pool viewed as [P * Hkv * page, D] per kept token and head.
        head = torch.arange(heads, device=k.device)
        flat = ((page[:, None] * heads + head) * size + (pos % size)[:, None]).reshape(-1)
        where = rows.memo[key] = (keep, flat)
    assert isinstance(where, tuple)
    keep, flat = where
    if keep is not None:
        k, v = k.index_select(0, keep), v.index_select(0, keep)
    k_pool.view(-1, k_pool.shape[-1]).index_copy_(0, flat, k.reshape(-1, k.shape[-1]))
    v_pool.view(-1, v_pool.shape[-1]).index_copy_(0, flat, v.reshape(-1, v.shape[-1]))
