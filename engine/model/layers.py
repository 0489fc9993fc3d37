"""Building blocks shared by every backbone: RoPE, attention over the paged cache (one row at
a time, over exactly its own keys, with the twins; one paged canvas-attention kernel over all
rows with the Triton kernels), gated MLPs, the self-conditioning block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.model.config import LayerSpec, RopeSpec, TextConfig
from engine.model.kv_cache import ForwardBatch, Mode, PagedKVCache


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] of one layer type (default or proportional RoPE)."""
    if rope.rope_type == "proportional":
        rope_angles = int(rope.partial_rotary_factor * head_dim // 2)
        exponent = torch.arange(0, 2 * rope_angles, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (rope.theta**exponent)
        nope = head_dim // 2 - rope_angles
        if nope > 0:
            inv_freq = torch.cat([inv_freq, torch.zeros(nope, dtype=torch.float32)])
        return inv_freq / rope.factor
    dim = int(head_dim * rope.partial_rotary_factor)
    return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, D]."""
    return x * cos[:, :, None] + rotate_half(x) * sin[:, :, None]


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.eps = cfg.rms_norm_eps
        hidden, num_heads = cfg.hidden_size, cfg.num_heads
        self.q_proj = nn.Linear(hidden, num_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = (
            nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=False)
            if spec.has_v_proj
            else None
        )
        self.o_proj = nn.Linear(num_heads * spec.head_dim, hidden, bias=False)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else spec.head_dim**-0.5
        self.qkv_norm = cfg.qk_norm  # Gemma: weighted q/k norms and an unweighted v norm
        if self.qkv_norm:
            _norm_weight(self, "q_norm", spec.head_dim)
            _norm_weight(self, "k_norm", spec.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """x: [1, N, H] packed tokens of all rows. Returns [1, N, H]."""
        ops = kernels.ops(x.device.type)
        seg = batch.segments
        shape = (1, x.shape[1], -1, self.spec.head_dim)
        cos, sin = rope
        q = ops.segment_linear(x, self.q_proj.weight, seg).view(shape)
        k = ops.segment_linear(x, self.k_proj.weight, seg).view(shape)
        v = k  # full layers of DiffusionGemma have no v_proj: V is the raw k_proj output
        if self.v_proj is not None:
            v = ops.segment_linear(x, self.v_proj.weight, seg).view(shape)
        if self.qkv_norm:
            q = ops.rms_norm(q, self.q_norm.weight, self.eps)
            v = ops.rms_norm(v, None, self.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.eps)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [1, Hq, N, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if self._use_paged_kernel(ops, cache):
            out = self._attend_paged(ops, q, k, v, layer, batch, cache)
            return ops.segment_linear(out.reshape(1, x.shape[1], -1), self.o_proj.weight, seg)
        if len(batch.rows) == 1:  # the common offline case: no slicing, no copies
            out = self._attend_row(q, k, v, 0, layer, batch, cache)
        else:
            # One row at a time, each over exactly its own keys: a row's values never depend
            # on what else shares the batch (batch invariance).
            parts = []
            for i, (o, n) in enumerate(zip(batch.offsets, seg, strict=True)):
                sl = slice(o, o + n)
                parts.append(
                    self._attend_row(q[:, :, sl], k[:, :, sl], v[:, :, sl], i, layer, batch, cache)
                )
            out = torch.cat(parts, dim=2)
        out = out.transpose(1, 2).reshape(1, x.shape[1], -1)
        return ops.segment_linear(out, self.o_proj.weight, seg)

    def _use_paged_kernel(self, ops: object, cache: object) -> bool:
        """The Triton path: Triton kernels (CUDA, or CANVAS_TRITON_ON_CPU) over a PagedKVCache
        (never TrainKVCache: the kernels have no backward) at a head_dim they support. The twins
        keep the per-row path, whose numbers match transformers bit for bit on CPU."""
        head_dim = self.spec.head_dim
        return (
            ops is not kernels.reference
            and isinstance(cache, PagedKVCache)
            and head_dim >= 16
            and head_dim & (head_dim - 1) == 0
        )

    def _attend_paged(
        self,
        ops: object,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """All rows at once: q [1, Hq, N, D], new k/v [1, Hkv, N, D]. ENCODE rows' KV goes into
        the pools (`write_kv`), then one `canvas_attention` reads every row's prefix straight
        from the pages. Returns [1, N, Hq, D]."""
        rows = batch.paged_rows(cache.layer_types[layer], q.device)
        window = batch.sliding_window if self.spec.is_sliding else 0
        q, k, v = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
        k_pool, v_pool = cache.keys[layer], cache.values[layer]
        ops.write_kv(k, v, k_pool, v_pool, rows)
        out = ops.canvas_attention(q, k, v, k_pool, v_pool, rows, window, self.scale)
        return out[None]

    def _attend_row(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: int,
        layer: int,
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """One row: q [1, Hq, T, D], new k/v [1, Hkv, T, D]. ENCODE rows write their KV first.
        Keys are the row's cached prefix range then its new tokens. Returns [1, Hq, T, D]."""
        row = batch.rows[index]
        if row.mode is Mode.ENCODE:
            cache.write(layer, row, k[0], v[0])
        sliding = self.spec.is_sliding
        prefix_k, prefix_v = cache.gather(layer, row, *batch.key_range(row, sliding))
        keys = torch.cat([prefix_k, k], dim=2)
        values = torch.cat([prefix_v, v], dim=2)
        mask = batch.mask(index, sliding, q.device)
        return kernels.ops(q.device.type).attention(q, keys, values, mask, self.scale)


ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): GeGLU (Gemma) or SwiGLU (Llama)."""

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, segments: list[int]) -> torch.Tensor:
        linear = kernels.ops(x.device.type).segment_linear
        gate = self.act(linear(x, self.gate_proj.weight, segments))
        return linear(
            gate * linear(x, self.up_proj.weight, segments), self.down_proj.weight, segments
        )


def _norm_weight(module: nn.Module, name: str, dim: int) -> None:
    sub = nn.Module()
    sub.weight = nn.Parameter(torch.ones(dim))
    module.add_module(name, sub)


class SelfConditioning(GatedMLP):
    """Gated MLP over the previous step's soft embeddings, added to the canvas embeddings
    (then RMS-normed without weight in DiffusionGemma; left as is in converted backbones, whose
    decoder starts as the bidirectional encoder)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        self.eps = cfg.rms_norm_eps
        self.post_norm = cfg.sc_post_norm
        _norm_weight(self, "pre_norm", cfg.hidden_size)

    def condition(
        self, embeds: torch.Tensor, soft_embeds: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        ops = kernels.ops(embeds.device.type)
        signal = self(ops.rms_norm(soft_embeds, self.pre_norm.weight, self.eps), segments)
        return ops.rms_norm(embeds + signal, None, self.eps) if self.post_norm else embeds + signal
