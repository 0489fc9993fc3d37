"""A Llama-style backbone in the block-diffusion scheme: the layers of an AR Llama checkpoint
(pre-norm, attention, SwiGLU MLP) run as DiffusionGemma's two modes — causal ENCODE rows that
write KV, bidirectional DECODE rows over the canvas — plus the self-conditioning block.
`canvas convert` produces such checkpoints (model_type "canvas_llama")."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.base import DiffusionLM
from engine.model.config import LayerSpec, TextConfig
from engine.model.kv_cache import ForwardBatch, KVCache
from engine.model.layers import UNBOUND, Attention, GatedMLP, _norm_weight


class LlamaLayer(nn.Module):
    def __init__(self, cfg: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.kernels = UNBOUND
        self.self_attn = Attention(cfg, spec)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        _norm_weight(self, "input_layernorm", cfg.hidden_size)
        _norm_weight(self, "post_attention_layernorm", cfg.hidden_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        norm = self.kernels.rms_norm
        x = x + self.self_attn(
            norm(x, self.input_layernorm.weight, self.eps), rope, layer, batch, cache
        )
        return x + self.mlp(norm(x, self.post_attention_layernorm.weight, self.eps), batch.segments)


class LlamaDiffusion(DiffusionLM):
    """A converted Llama-style stack."""

    def make_layer(self, cfg: TextConfig, spec: LayerSpec) -> nn.Module:
        return LlamaLayer(cfg, spec)
