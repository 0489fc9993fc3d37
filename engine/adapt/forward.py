"""The model's forward for training and scoring: a functional KV cache that autograd flows
through, and the head without in-place ops.

The serving path (`engine.model`) keeps only the paged cache and an in-place head; training
needs neither in-place writes nor page tables. Rows of a `TrainKVCache` are named by their
index in the batch: row i of every batch passed to one cache is sequence i (its ENCODE rows
write sequence i's KV, its DECODE rows read it), so no page tables are needed.
"""

from __future__ import annotations

import torch

from engine.model import DiffusionLM, ForwardBatch, Mode, Row
from kernels import KernelSet
from kernels.reference import attention

NO_PAGES = 0  # page size of a training batch: `TrainKVCache` is not paged


def train_batch(
    mode: Mode, starts: list[int], lengths: list[int], sliding_window: int
) -> ForwardBatch:
    """One row per sequence (sequence i is row i), without page tables."""
    rows = [Row(mode, s, n, {}) for s, n in zip(starts, lengths, strict=True)]
    return ForwardBatch(rows, sliding_window, NO_PAGES)


def train_logits(model: DiffusionLM, hidden: torch.Tensor) -> torch.Tensor:
    """The tied, soft-capped head in fp32, out of place (autograd-friendly); the same values as
    `DiffusionLM.logits`, which caps in place for inference."""
    logits = model.lm_head(hidden)  # [N, V]
    cap = model.cfg.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


class TrainKVCache:
    """KV storage for training and scoring, implementing `engine.model.kv_cache.KVCache`:
    functional (no in-place writes), so gradients flow from the decoder's loss back through the
    prefix keys into the encoder. Attention runs one row at a time with an explicit mask (the
    reference's order)."""

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(
        self,
        kernels: KernelSet,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        window: int,
        scale: float,
    ) -> torch.Tensor:
        """See `KVCache.attend`."""
        parts = []
        for seq, (row, offset) in enumerate(zip(batch.rows, batch.offsets, strict=True)):
            new = slice(offset, offset + row.num_tokens)
            row_k, row_v = k[new].transpose(0, 1), v[new].transpose(0, 1)  # [Hkv, T, D]
            if row.mode is Mode.ENCODE:
                self._write(layer, seq, row, row_k, row_v)
            lo = max(0, row.start - (window - 1)) if window > 0 else 0
            prefix_k, prefix_v = self._gather(layer, seq, lo, row.start)
            keys = torch.cat([prefix_k, row_k[None]], dim=2)
            values = torch.cat([prefix_v, row_v[None]], dim=2)
            mask = _row_mask(row, lo, window, q.device)
            out = attention(q[new].transpose(0, 1)[None], keys, values, mask, scale)
            parts.append(out[0].transpose(0, 1))
        return torch.cat(parts)

    def layers_of(self, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Sequence `seq`'s cached (K, V) on every layer, [Hkv, T, D] each, in layer order."""
        num_layers = 1 + max(layer for layer, s in self._kv if s == seq)
        return [self._kv[(layer, seq)] for layer in range(num_layers)]

    def set_prefix(
        self, seq: int, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int
    ) -> None:
        """Make the first `length` positions of `layers` (as `layers_of` returns them)
        sequence `seq`'s cached prefix: a DECODE row of `seq` starting at `length` reads it."""
        for layer, (k, v) in enumerate(layers):
            self._kv[(layer, seq)] = (k[:, :length], v[:, :length])

    def _write(self, layer: int, seq: int, row: Row, k: torch.Tensor, v: torch.Tensor) -> None:
        key = (layer, seq)
        if key in self._kv:
            old_k, old_v = self._kv[key]
            k = torch.cat([old_k[:, : row.start], k], dim=1)
            v = torch.cat([old_v[:, : row.start], v], dim=1)
        elif row.start != 0:
            raise ValueError(f"sequence {seq}: first write must start at position 0")
        self._kv[key] = (k, v)

    def _gather(self, layer: int, seq: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, seq)
        if key not in self._kv:
            raise KeyError(f"sequence {seq} has no cached prefix on layer {layer}")
        k, v = self._kv[key]
        return k[None, :, lo:hi], v[None, :, lo:hi]


def _row_mask(row: Row, lo: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [1, 1, T, S + T] over a row's keys (its cached range from `lo`, then its
    new tokens), or None when every query sees every key (DECODE rows)."""
    if row.mode is Mode.DECODE:
        return None  # the canvas sees all of its prefix range and all of itself
    key_pos = torch.cat(
        [torch.arange(lo, row.start), torch.arange(row.start, row.start + row.num_tokens)]
    )
    q_pos = torch.arange(row.start, row.start + row.num_tokens)[:, None]
    mask = key_pos[None, :] <= q_pos
    if window > 0:
        mask &= key_pos[None, :] > q_pos - window
    return mask[None, None].to(device)
