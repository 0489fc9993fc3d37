"""KV storage and the per-forward attention metadata.

The model never indexes the cache itself: each attention layer calls `cache.write(...)` (encoder
rows) and `cache.read(...)` (every row) with a `ForwardBatch` that says, per row, which sequence
slot it belongs to, where its new tokens start and how many there are. Rows may have different
prefix lengths; masks are built once per forward and per layer type.

`DenseKVCache` keeps one contiguous region per slot (enough for offline generation and tests).
A paged cache implements the same two methods over a page table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from engine.model.config import LayerSpec, TextConfig


class Mode(str, Enum):
    ENCODE = "encode"  # causal over the new tokens, writes their KV (prefill and commit passes)
    DECODE = "decode"  # bidirectional over the canvas, reads the prefix KV read-only


@dataclass(slots=True)
class ForwardBatch:
    """What one forward pass runs over. All rows share the padded length T of the input."""

    mode: Mode
    slots: torch.Tensor  # [B] cache slot of each row
    start_pos: torch.Tensor  # [B] prefix length before the new tokens
    num_tokens: torch.Tensor  # [B] valid new tokens per row (<= T)
    sliding_window: int
    _masks: dict[tuple[bool, int], torch.Tensor | None] = field(default_factory=dict)
    _host_start: list[int] = field(default_factory=list)
    _host_num: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._host_start = self.start_pos.tolist()
        self._host_num = self.num_tokens.tolist()

    @property
    def positions(self) -> torch.Tensor:
        """[B, T] absolute positions of the new tokens."""
        width = max(self._host_num)
        return self.start_pos[:, None] + torch.arange(width, device=self.start_pos.device)

    def key_range(self, sliding: bool) -> tuple[int, int]:
        """[lo, hi) of cached positions any row may read on this layer type."""
        if self.mode is Mode.ENCODE:
            hi = max(s + n for s, n in zip(self._host_start, self._host_num, strict=True))
        else:
            hi = max(self._host_start)
        lo = max(0, min(self._host_start) - (self.sliding_window - 1)) if sliding else 0
        return lo, hi

    def mask(self, sliding: bool, num_queries: int, device: torch.device) -> torch.Tensor | None:
        """Boolean attention mask [B, 1, T, S] for this layer type (True = attend), or None when
        every query may see every key. In DECODE mode the keys are the read prefix followed by
        the canvas; in ENCODE mode they are the read range (which includes the new tokens)."""
        key = (sliding, num_queries)
        if key not in self._masks:
            self._masks[key] = self._build_mask(sliding, num_queries, device)
        return self._masks[key]

    def _build_mask(
        self, sliding: bool, num_queries: int, device: torch.device
    ) -> torch.Tensor | None:
        lo, hi = self.key_range(sliding)
        kv_pos = torch.arange(lo, hi, device=device)  # [S]
        start = self.start_pos.to(device)[:, None, None]  # [B, 1, 1]
        window = self.sliding_window
        if self.mode is Mode.ENCODE:
            q_pos = start + torch.arange(num_queries, device=device)[None, :, None]  # [B, T, 1]
            mask = kv_pos[None, None, :] <= q_pos
            if sliding:
                mask &= kv_pos[None, None, :] > q_pos - window
            return mask[:, None]
        # DECODE: the prefix part, then the canvas part (always visible).
        prefix = kv_pos[None, None, :] < start
        if sliding:
            # The reference's sliding cache holds the last `window - 1` prefix tokens; the canvas
            # sees all of them and all of itself.
            prefix &= kv_pos[None, None, :] >= start - (window - 1)
        if bool(prefix.all()):
            return None
        prefix = prefix.expand(-1, num_queries, -1)
        canvas = torch.ones(
            prefix.shape[0], num_queries, num_queries, dtype=torch.bool, device=device
        )
        return torch.cat([prefix, canvas], dim=-1)[:, None]


class KVCache(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        """Store the new tokens' k, v ([B, Hkv, T, D]) of every row at its positions."""
        ...

    def read(
        self, layer: int, batch: ForwardBatch, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached k, v ([B, Hkv, hi-lo, D]) of positions [lo, hi) for each row's slot."""
        ...


class DenseKVCache:
    """One contiguous [Hkv, max_len, D] region per slot and layer."""

    def __init__(
        self,
        config: TextConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for spec in config.layers:
            shape = (num_slots, spec.num_kv_heads, max_len, spec.head_dim)
            self.keys.append(torch.zeros(shape, dtype=dtype, device=device))
            self.values.append(torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def layer_shape(spec: LayerSpec) -> tuple[int, int]:
        return spec.num_kv_heads, spec.head_dim

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        slots = batch.slots.tolist()
        for row, (slot, start, num) in enumerate(
            zip(slots, batch._host_start, batch._host_num, strict=True)
        ):
            if start + num > self.max_len:
                raise RuntimeError(f"KV cache slot {slot} overflow: {start + num} > {self.max_len}")
            self.keys[layer][slot, :, start : start + num] = k[row, :, :num]
            self.values[layer][slot, :, start : start + num] = v[row, :, :num]

    def read(
        self, layer: int, batch: ForwardBatch, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.slots.numel() == 1:
            slot = int(batch.slots[0])
            return (
                self.keys[layer][slot : slot + 1, :, lo:hi],
                self.values[layer][slot : slot + 1, :, lo:hi],
            )
        return self.keys[layer][batch.slots, :, lo:hi], self.values[layer][batch.slots, :, lo:hi]
