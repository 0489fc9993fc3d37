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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import LayerSpec, LayerType, ModelConfig, TextConfig
from engine.model.kv_cache import ForwardBatch, KVCache, Mode
from engine.model.layers import UNBOUND, RMSNorm, SelfConditioning, rope_inv_freq
from engine.model.vision import VisionTower
from kernels import KernelSet

if TYPE_CHECKING:
    from engine.model.adapter import DecoderAdapter


class Embedding(nn.Module):
    """The (tied) embedding matrix [V, H]: `embed_tokens.weight` in checkpoints. Its three
    products are methods, so that a vocabulary-parallel shard can take its place
    (`engine.parallel.layers.VocabParallelEmbedding`)."""

    weight: nn.Parameter

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, hidden_size))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids`: [..., H]."""
        return F.embedding(ids, self.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] @ E^T: [..., V] in the weight's dtype."""
        return F.linear(hidden, self.weight)

    def mix(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [..., V] @ E: [..., H]."""
        return torch.matmul(probs, self.weight)


class DiffusionLM(nn.Module):
    """A block-diffusion LM: one stack of layers run in two modes (see `forward`). Subclasses
    supply the layer type (`make_layer`) and their config.json text_config parser
    (`parse_text_config`); `engine.model.loader.BACKBONES` registers them by model_type."""

    parse_text_config: Callable[[dict[str, Any]], TextConfig]

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        cfg = config.text
        self.config = config
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([self.make_layer(cfg, spec) for spec in cfg.layers])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)
        self.adapter: DecoderAdapter | None = None  # see engine.model.adapter (DECODE rows only)
        self.vision = (
            VisionTower(config.vision, cfg.hidden_size) if config.vision is not None else None
        )
        self.kernels = UNBOUND
        self.init_rope()

    def bind_kernels(self, kernels: KernelSet) -> None:
        """Bind a kernel set (numerics and backend) onto every module that calls kernels: the
        one choice, made at load (gpt-fast style); nothing is looked up per call. The modules
        share one `kernels.for_model()`, made here: the backend's state for this model (the
        native kernels' store of packed weights, each packed once), gone with the model."""
        kernels = kernels.for_model()
        for module in reversed(list(self.modules())):  # parts first: a layer's choices read them
            bind = getattr(module, "bind", None)  # Attention, GatedMLP, a layer: FP8 choices
            if bind is not None:
                bind(kernels)
            elif hasattr(module, "kernels"):
                object.__setattr__(module, "kernels", kernels)  # a plain attribute

    def make_layer(self, cfg: TextConfig, spec: LayerSpec) -> nn.Module:
        raise NotImplementedError

    def init_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE inverse frequencies, one table per layer type (and the vision
        tower's)."""
        if getattr(self, "vision", None) is not None:
            self.vision.init_rope(device)  # type: ignore[union-attr]
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
        return self.embed_tokens.lookup(ids) * self.embed_scale

    def soft_embed(
        self, scaled_logits: torch.Tensor, probs: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Self-conditioning signal [..., H] from the previous step's temperature-scaled logits
        [..., V]: softmax(logits in the model dtype, fp32) @ E * sqrt(H). `probs`, when given,
        is softmax(scaled_logits) in fp32 and is reused for an fp32 model."""
        weight = self.embed_tokens.weight
        if probs is None or weight.dtype != torch.float32:
            probs = torch.softmax(scaled_logits.to(weight.dtype), dim=-1, dtype=torch.float32)
        return self.embed_tokens.mix(probs.to(weight.dtype)) * self.embed_scale

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied head before soft-capping, in fp32: [..., V]."""
        return self.embed_tokens.project(hidden).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tied, soft-capped head in fp32, for inference, through the bound `softcap` (the twin
        caps in place, the [rows, vocab] buffer being the step's largest; Triton converts and
        caps in one pass), so autograd cannot run through it; training uses
        `engine.adapt.forward.train_logits` (the twin's values, bit for bit)."""
        raw = self.embed_tokens.project(hidden)  # the model dtype
        return self.kernels.softcap(raw, self.cfg.final_logit_softcapping)

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
        soft_embeds: SoftEmbeds,
        batch: ForwardBatch,
        cache: KVCache,
        images: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """One pass over the packed new tokens `ids` [N] of every row in `batch`.

        ENCODE rows are embedded as is and write their KV; DECODE rows are canvases whose
        embeddings are self-conditioned on `soft_embeds`: the previous step's soft embeddings
        of the DECODE rows in row order, either one tensor [num_decode_tokens, H] (zeros on a
        canvas's first step) or one entry per DECODE row ([L, H], or None on the first step).
        `images`: (packed indices [M] of ENCODE rows' image tokens, the vision tower's soft
        tokens [M, H] for them), which replace those tokens' embeddings as the reference's
        `masked_scatter` does. Returns the final hidden states [N, H].
        """
        x = self._embed_rows(ids, soft_embeds, batch, images)[None]  # [1, N, H]
        rope = self._rope(batch.positions(ids.device)[None], x.dtype)
        for i, (layer, spec) in enumerate(zip(self.layers, self.cfg.layers, strict=True)):
            x = layer(x, rope[spec.layer_type], i, batch, cache)
        hidden = self.norm(x)[0]
        return hidden if self.adapter is None else self.adapter.shift(hidden, batch)

    def _embed_rows(
        self,
        ids: torch.Tensor,
        soft_embeds: SoftEmbeds,
        batch: ForwardBatch,
        images: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        embeds = self.embed(ids)  # [N, H]
        if images is not None:
            index, features = images
            embeds = embeds.index_copy(0, index, features.to(embeds.dtype))
        is_decode = [row.mode is Mode.DECODE for row in batch.rows]
        if not any(is_decode):
            return embeds
        if all(is_decode):
            canvas = embeds
        else:
            index = batch.decode_index(ids.device)  # [num_decode_tokens]
            canvas = embeds[index]
        if isinstance(soft_embeds, torch.Tensor):
            soft = soft_embeds.to(embeds.dtype)
        else:
            assert len(soft_embeds) == sum(is_decode), "one soft-embedding entry per DECODE row"
            spans = [row.num_tokens for row in batch.rows if row.mode is Mode.DECODE]
            soft = torch.cat(
                [
                    s if s is not None else embeds.new_zeros(n, embeds.shape[1])
                    for s, n in zip(soft_embeds, spans, strict=True)
                ]
            ).to(embeds.dtype)
        segments = [row.num_tokens for row in batch.rows if row.mode is Mode.DECODE]
        if self.adapter is not None:
            canvas = self.adapter.embed(canvas, segments)
        conditioned = self.self_conditioning.condition(canvas[None], soft[None], segments)[0]
        if all(is_decode):
            return conditioned
        return embeds.index_copy(0, index, conditioned)


# The previous step's soft embeddings of a forward's DECODE rows (see `DiffusionLM.forward`).
SoftEmbeds = torch.Tensor | list[torch.Tensor | None]
# Image soft tokens for a forward: (packed token indices [M], features [M, H]).
ImageEmbeds = tuple[torch.Tensor, torch.Tensor]
