"""The backbone-independent part of a block-diffusion LM: embeddings, self-conditioning input,
RoPE tables, the tied (optionally soft-capped) head, and the mixed ENCODE/DECODE forward.

- ENCODE rows: causal over new tokens (a prompt chunk, a committed canvas, an AR token),
  writing their KV.
- DECODE rows: bidirectional over a canvas, reading the cached prefix read-only, with the
  self-conditioning signal added to the canvas embeddings.

One `forward` runs any mix of both kinds of rows (see `kv_cache.ForwardBatch`). Parameter names
follow DiffusionGemma's decoder checkpoint names (`layers.{i}.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.model.config import LayerSpec, LayerType, ModelConfig, TextConfig
from engine.model.kv_cache import ForwardBatch, Mode, PagedKVCache
from engine.model.layers import SelfConditioning, _norm_weight, rope_inv_freq


class DiffusionLM(nn.Module):
    """A block-diffusion LM: one stack of layers run in two modes (see `forward`). Subclasses
    supply the layer type (`make_layer`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.text
        self.config = config
        self.cfg = cfg
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList([self.make_layer(cfg, spec) for spec in cfg.layers])
        _norm_weight(self, "norm", cfg.hidden_size)
        self.self_conditioning = SelfConditioning(cfg)
        self.init_rope()

    def make_layer(self, cfg: TextConfig, spec: LayerSpec) -> nn.Module:
        raise NotImplementedError

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
        # Gemma keeps sqrt(hidden) as an fp32 buffer and casts it to the weight dtype.
        scale = math.sqrt(self.cfg.hidden_size) if self.cfg.embed_scale else 1.0
        return torch.tensor(scale).to(self.embed_tokens.weight.dtype)

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
        if cap is None:
            return logits
        if torch.is_grad_enabled():
            return torch.tanh(logits / cap) * cap
        # In place (same values, bit for bit): the [rows, vocab] buffer is the step's largest.
        return logits.div_(cap).tanh_().mul_(cap)

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

    def forward(
        self,
        ids: torch.Tensor,
        soft_embeds: list[torch.Tensor | None],
        batch: ForwardBatch,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """One pass over the packed new tokens `ids` [N] of every row in `batch`.

        ENCODE rows are embedded as is and write their KV; DECODE rows are canvases whose
        embeddings are self-conditioned on `soft_embeds` (one entry per DECODE row, in row
        order: the previous step's soft embeddings [L, H], or None on a canvas's first step).
        Returns the final hidden states [N, H].
        """
        x = self._embed_rows(ids, soft_embeds, batch)[None]  # [1, N, H]
        rope = self._rope(batch.positions(ids.device)[None], x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope[layer.self_attn.spec.layer_type], i, batch, cache)
        return kernels.ops(x.device.type).rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps)[0]

    def _embed_rows(
        self, ids: torch.Tensor, soft_embeds: list[torch.Tensor | None], batch: ForwardBatch
    ) -> torch.Tensor:
        embeds = self.embed(ids)  # [N, H]
        decode = [i for i, row in enumerate(batch.rows) if row.mode is Mode.DECODE]
        if not decode:
            return embeds
        assert len(soft_embeds) == len(decode), "one soft-embedding entry per DECODE row"
        spans = [(batch.offsets[i], batch.rows[i].num_tokens) for i in decode]
        canvas = (
            torch.cat([embeds[o : o + n] for o, n in spans])
            if len(decode) > 1
            else embeds[spans[0][0] : spans[0][0] + spans[0][1]]
        )
        soft = torch.cat(
            [
                s
                if s is not None
                else torch.zeros(n, embeds.shape[1], dtype=embeds.dtype, device=embeds.device)
                for s, (_, n) in zip(soft_embeds, spans, strict=True)
            ]
        ).to(embeds.dtype)
        conditioned = self.self_conditioning.condition(
            canvas[None], soft[None], [n for _, n in spans]
        )[0]
        if len(decode) == len(batch.rows):
            return conditioned
        out = embeds.clone()
        pos = 0
        for o, n in spans:
            out[o : o + n] = conditioned[pos : pos + n]
            pos += n
        return out
