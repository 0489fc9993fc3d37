"""Native DiffusionGemma text stack: one set of weights, two modes.

- `encode`: causal over new tokens (a prompt chunk or a committed canvas), writes their KV.
- `decode`: bidirectional over a canvas, reads the cached prefix read-only, with the
  self-conditioning signal added to the canvas embeddings.

Parameter names follow the checkpoint's decoder names (`layers.{i}.self_attn.q_proj.weight`,
...) so the loader maps them one to one. The only per-mode weights are the layer scalars
(`encoder_layer_scalar`, `decoder_layer_scalar`): the checkpoint stores them as separate buffers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.model.config import LayerSpec, LayerType, ModelConfig, RopeSpec, TextConfig
from engine.model.kv_cache import ForwardBatch, KVCache, Mode


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
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.ones(spec.head_dim))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(spec.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        ops = kernels.ops(x.device.type)
        num_rows, num_tokens, _ = x.shape
        shape = (num_rows, num_tokens, -1, self.spec.head_dim)
        cos, sin = rope
        q = apply_rope(
            ops.rms_norm(self.q_proj(x).view(shape), self.q_norm.weight, self.eps), cos, sin
        )
        k_raw = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape) if self.v_proj is not None else k_raw
        k = apply_rope(ops.rms_norm(k_raw, self.k_norm.weight, self.eps), cos, sin).transpose(1, 2)
        v = ops.rms_norm(v, None, self.eps).transpose(1, 2)
        q = q.transpose(1, 2)  # [B, Hq, T, D]
        sliding = self.spec.is_sliding
        lo, hi = batch.key_range(sliding)
        if batch.mode is Mode.ENCODE:
            cache.write(layer, k, v, batch)
            keys, values = cache.read(layer, batch, lo, hi)
        else:
            prefix_k, prefix_v = cache.read(layer, batch, lo, hi)
            keys, values = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
        mask = batch.mask(sliding, num_tokens, x.device)
        out = ops.attention(q, keys, values, mask, 1.0)
        return self.o_proj(out.transpose(1, 2).reshape(num_rows, num_tokens, -1))


class GeGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def _norm_weight(module: nn.Module, name: str, dim: int) -> None:
    sub = nn.Module()
    sub.weight = nn.Parameter(torch.ones(dim))
    module.add_module(name, sub)


class Layer(nn.Module):
    """Attention, then the dense GeGLU MLP and the MoE branch side by side."""

    NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_feedforward_layernorm_1",
        "post_feedforward_layernorm_2",
        "pre_feedforward_layernorm_2",
    )

    def __init__(self, cfg: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn = Attention(cfg, spec)
        self.mlp = GeGLU(cfg.hidden_size, cfg.intermediate_size)
        for name in self.NORMS:
            _norm_weight(self, name, cfg.hidden_size)
        self.router = nn.Module()
        self.router.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.router.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.router.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.experts = nn.Module()
        inter = cfg.moe_intermediate_size
        self.experts.gate_up_proj = nn.Parameter(
            torch.zeros(cfg.num_experts, 2 * inter, cfg.hidden_size)
        )
        self.experts.down_proj = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, inter))
        # Buffers in the checkpoint (not tied between the modes, not trained).
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        self.register_buffer("decoder_layer_scalar", torch.ones(1))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return kernels.ops(x.device.type).rms_norm(
            x, getattr(self, name).weight, self.cfg.rms_norm_eps
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        ops = kernels.ops(x.device.type)
        residual = x
        h = self.self_attn(self._norm("input_layernorm", x), rope, layer, batch, cache)
        x = residual + self._norm("post_attention_layernorm", h)

        residual = x
        dense = self._norm(
            "post_feedforward_layernorm_1", self.mlp(self._norm("pre_feedforward_layernorm", x))
        )
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = ops.route_experts(
            flat,
            self.router.scale,
            self.router.proj.weight,
            self.router.per_expert_scale,
            self.cfg.top_k_experts,
            self.cfg.rms_norm_eps,
        )
        moe = ops.fused_moe(
            self._norm("pre_feedforward_layernorm_2", flat),
            self.experts.gate_up_proj,
            self.experts.down_proj,
            weights,
            ids,
        )
        moe = self._norm("post_feedforward_layernorm_2", moe.reshape(x.shape))
        x = residual + self._norm("post_feedforward_layernorm", dense + moe)
        scalar = (
            self.encoder_layer_scalar if batch.mode is Mode.ENCODE else self.decoder_layer_scalar
        )
        return x * scalar


class SelfConditioning(GeGLU):
    """Gated MLP over the previous step's soft embeddings, added to the canvas embeddings."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps
        _norm_weight(self, "pre_norm", cfg.hidden_size)

    def condition(self, embeds: torch.Tensor, soft_embeds: torch.Tensor) -> torch.Tensor:
        ops = kernels.ops(embeds.device.type)
        signal = self(ops.rms_norm(soft_embeds, self.pre_norm.weight, self.eps))
        return ops.rms_norm(embeds + signal, None, self.eps)


class DiffusionGemma(nn.Module):
    """The DiffusionGemma text stack. See the module docstring for the two modes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.text
        self.config = config
        self.cfg = cfg
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList([Layer(cfg, spec) for spec in cfg.layers])
        _norm_weight(self, "norm", cfg.hidden_size)
        self.self_conditioning = SelfConditioning(cfg)
        self.init_rope()

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE inverse frequencies, one table per layer type."""
        for layer_type in LayerType:
            dims = {s.head_dim for s in self.cfg.layers if s.layer_type is layer_type}
            if dims:
                (head_dim,) = dims  # one head_dim per layer type (as the reference assumes)
                inv_freq = rope_inv_freq(self.cfg.rope[layer_type], head_dim)
                self.register_buffer(
                    f"inv_freq_{layer_type.name}", inv_freq.to(device), persistent=False
                )

    # -- pieces ------------------------------------------------------------------------------

    @property
    def embed_scale(self) -> torch.Tensor:
        # The reference keeps sqrt(hidden) as an fp32 buffer and casts it to the weight dtype.
        return torch.tensor(math.sqrt(self.cfg.hidden_size)).to(self.embed_tokens.weight.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_tokens.weight) * self.embed_scale

    def soft_embed(
        self, scaled_logits: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Self-conditioning signal [..., H] from the previous step's temperature-scaled logits
        [..., V]: softmax(logits in the model dtype, fp32) @ E * sqrt(H). `probs`, when given,
        is softmax(scaled_logits) in fp32 and is reused for an fp32 model."""
        weight = self.embed_tokens.weight
        if probs is None or weight.dtype != torch.float32:
            probs = torch.softmax(scaled_logits.to(weight.dtype), dim=-1, dtype=torch.float32)
        return torch.matmul(probs.to(weight.dtype), weight) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied, soft-capped head in fp32."""
        logits = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[LayerType, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for layer_type in LayerType:
            inv_freq = getattr(self, f"inv_freq_{layer_type.name}", None)
            if inv_freq is None:
                continue
            freqs = positions[..., None].float() * inv_freq.float()
            emb = torch.cat((freqs, freqs), dim=-1)
            out[layer_type] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out

    def _stack(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        rope = self._rope(batch.positions[:, : x.shape[1]], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope[layer.self_attn.spec.layer_type], i, batch, cache)
        return kernels.ops(x.device.type).rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps)

    # -- the two modes -------------------------------------------------------------------------

    def encode(self, ids: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Causal pass over new tokens ids [B, T]; writes their KV. Returns hidden [B, T, H]."""
        assert batch.mode is Mode.ENCODE
        return self._stack(self.embed(ids), batch, cache)

    def decode(
        self,
        canvas: torch.Tensor,
        soft_embeds: torch.Tensor | None,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """Bidirectional pass over canvas [B, L] given the soft embeddings [B, L, H] of the
        previous step (None on the first step). Returns final hidden [B, L, H]."""
        assert batch.mode is Mode.DECODE
        embeds = self.embed(canvas)
        if soft_embeds is None:
            soft_embeds = torch.zeros_like(embeds)
        x = self.self_conditioning.condition(embeds, soft_embeds.to(embeds.dtype))
        return self._stack(x, batch, cache)
