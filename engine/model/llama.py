"""A Llama-style backbone in the block-diffusion scheme: the layers of an AR Llama checkpoint
(pre-norm, attention, SwiGLU MLP) run as DiffusionGemma's two modes — causal ENCODE rows that
write KV, bidirectional DECODE rows over the canvas — plus the self-conditioning block.
`canvas convert` produces such checkpoints (model_type "canvas_llama")."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.base import DiffusionLM
from engine.model.config import LayerSpec, TextConfig, parse_llama_text_config
from engine.model.kv_cache import ForwardBatch, KVCache
from engine.model.layers import Attention, GatedMLP, RMSNorm


class LlamaLayer(nn.Module):
    def __init__(self, cfg: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, spec)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        # each norm as FP8 rows where the projections after it take them (sm_90's FP8 path)
        normed = self.input_layernorm(x, fp8=self.self_attn.fp8_rows)
        x = x + self.self_attn(normed, rope, layer, batch, cache)
        normed = self.post_attention_layernorm(x, fp8=self.mlp.fp8_rows)
        return x + self.mlp(normed, batch.segments, batch)


class LlamaDiffusion(DiffusionLM):
    """A converted Llama-style stack."""

    parse_text_config = staticmethod(parse_llama_text_config)

    def make_layer(self, cfg: TextConfig, spec: LayerSpec) -> nn.Module:
        return LlamaLayer(cfg, spec)
