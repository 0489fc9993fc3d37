"""Kernels as PyTorch custom ops (`torch.library`), so far the paged KV write and canvas
attention: `canvas::write_kv` and `canvas::canvas_attention`.

Each op has a fake (meta) implementation that gives its outputs' shapes without computing,
so a step can run on the meta device and be traced (and, on a GPU, be captured by CUDA graphs
or `torch.compile` without a graph break at the kernel). Its implementation is the twin
(`kernels.reference`) on every device but CUDA, where it is the Triton launcher when triton
is installed. The wrappers below take the twins' arguments; `KernelSet.with_custom_ops()`
binds them (fast numerics: the batched twins).

An op's arguments are tensors and plain values, so `PagedRows` travels as its five tensors
plus its host-side values, and is rebuilt inside the op without its memo: the twins then
build their index tensors once per call instead of once per forward. Attention also takes the
rows' optional `span` (`Tensor?`: None on the plain causal path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import kernels.reference as reference
from kernels.op_support import cuda_impl, fake
from kernels.reference import PagedRows


def _flat(rows: PagedRows) -> tuple[torch.Tensor, ...]:
    return rows.start, rows.offset, rows.num_tokens, rows.decode, rows.page_table


def _host(rows: PagedRows) -> list[int]:
    values = (rows.max_tokens, rows.max_start, rows.uniform, rows.min_start)
    return [int(x) for x in (*values, rows.all_decode, rows.no_decode)]


def _rows(
    flat: Sequence[torch.Tensor], host: list[int], span: torch.Tensor | None = None
) -> PagedRows:
    """`PagedRows` from `_flat`, `_host` and its span (without its memo)."""
    start, offset, num_tokens, decode, page_table = flat
    max_tokens, max_start, uniform, min_start, all_decode, no_decode = host
    return PagedRows(
        start, offset, num_tokens, decode, page_table, max_tokens, max_start, bool(uniform),
        min_start, bool(all_decode), bool(no_decode), span,
    )  # fmt: skip


@torch.library.custom_op("canvas::write_kv", mutates_args=("k_pool", "v_pool"))
def _write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    start: torch.Tensor,
    offset: torch.Tensor,
    num_tokens: torch.Tensor,
    decode: torch.Tensor,
    page_table: torch.Tensor,
    host: list[int],
) -> None:
    rows = _rows((start, offset, num_tokens, decode, page_table), host)
    reference.write_kv(k, v, k_pool, v_pool, rows)


# The other implementations take the op's arguments positionally, in its schema's order.
@_write_kv.register_kernel("cuda")
def _write_kv_cuda(*args: Any) -> None:
    k, v, k_pool, v_pool, *flat, host = args
    cuda_impl("triton_attention", "write_kv")(k, v, k_pool, v_pool, _rows(flat, host))  # type: ignore[operator]


@_write_kv.register_fake
def _write_kv_fake(*args: Any) -> None:
    return None


@torch.library.custom_op("canvas::canvas_attention", mutates_args=())
def _canvas_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    start: torch.Tensor,
    offset: torch.Tensor,
    num_tokens: torch.Tensor,
    decode: torch.Tensor,
    page_table: torch.Tensor,
    span: torch.Tensor | None,
    host: list[int],
    window: int,
    scale: float,
) -> torch.Tensor:
    rows = _rows((start, offset, num_tokens, decode, page_table), host, span)
    return reference.canvas_attention(q, k, v, k_pool, v_pool, rows, window, scale).contiguous()


@_canvas_attention.register_kernel("cuda")
def _canvas_attention_cuda(*args: Any) -> torch.Tensor:
    q, k, v, k_pool, v_pool, *flat, span, host, window, scale = args
    rows = _rows(flat, host, span)
    attend = cuda_impl("triton_attention", "canvas_attention")
    return attend(q, k, v, k_pool, v_pool, rows, window, scale)  # type: ignore[operator]


@_canvas_attention.register_fake
def _canvas_attention_fake(*args: Any) -> torch.Tensor:
    return fake(args[0], args[0].shape)  # q's shape


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: PagedRows
) -> None:
    """`reference.write_kv` as the op `canvas::write_kv`."""
    torch.ops.canvas.write_kv(k, v, k_pool, v_pool, *_flat(rows), _host(rows))


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
    """`reference.canvas_attention` as the op `canvas::canvas_attention`."""
    return torch.ops.canvas.canvas_attention(
        q, k, v, k_pool, v_pool, *_flat(rows), rows.span, _host(rows), window, scale
    )
