"""Native DiffusionGemma text stack: one set of weights, two modes.

- ENCODE rows: causal over new tokens (a prompt chunk, a committed canvas, an AR token),
  writing their KV.
- DECODE rows: bidirectional over a canvas, reading the cached prefix read-only, with the
  self-conditioning signal added to the canvas embeddings.

One `forward` runs any mix of both kinds of rows (see `kv_cache.ForwardBatch`).

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
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """x: [1, N, H] packed tokens of all rows. Returns [1, N, H]."""
        ops = kernels.ops(x.device.type)
        seg = batch.segments
        shape = (1, x.shape[1], -1, self.spec.head_dim)
        cos, sin = rope
        q = ops.rms_norm(
            ops.segment_linear(x, self.q_proj.weight, seg).view(shape), self.q_norm.weight, self.eps
        )
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [1, Hq, N, D]
        k_raw = ops.segment_linear(x, self.k_proj.weight, seg).view(shape)
        v = (
            ops.segment_linear(x, self.v_proj.weight, seg).view(shape)
            if self.v_proj is not None
            else k_raw
        )
        k = apply_rope(ops.rms_norm(k_raw, self.k_norm.weight, self.eps), cos, sin).transpose(1, 2)
        v = ops.rms_norm(v, None, self.eps).transpose(1, 2)
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
        return kernels.ops(q.device.type).attention(q, keys, values, mask, 1.0)


class GeGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, segments: list[int]) -> torch.Tensor:
        linear = kernels.ops(x.device.type).segment_linear
        gate = F.gelu(linear(x, self.gate_proj.weight, segments), approximate="tanh")
        return linear(
            gate * linear(x, self.up_proj.weight, segments), self.down_proj.weight, segments
        )


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
        cache: PagedKVCache,
    ) -> torch.Tensor:
        ops = kernels.ops(x.device.type)
        residual = x
        h = self.self_attn(self._norm("input_layernorm", x), rope, layer, batch, cache)
        x = residual + self._norm("post_attention_layernorm", h)

        residual = x
        seg = batch.segments
        dense = self._norm(
            "post_feedforward_layernorm_1",
            self.mlp(self._norm("pre_feedforward_layernorm", x), seg),
        )
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = ops.route_experts(
            flat,
            self.router.scale,
            self.router.proj.weight,
            self.router.per_expert_scale,
            self.cfg.top_k_experts,
            self.cfg.rms_norm_eps,
            seg,
        )
        moe = ops.fused_moe(
            self._norm("pre_feedforward_layernorm_2", flat),
            self.experts.gate_up_proj,
            self.experts.down_proj,
            weights,
            ids,
            seg,
        )
        moe = self._norm("post_feedforward_layernorm_2", moe.reshape(x.shape))
        x = residual + self._norm("post_feedforward_layernorm", dense + moe)
        return x * self.layer_scalar(batch)

    def layer_scalar(self, batch: ForwardBatch) -> torch.Tensor:
        """The per-mode layer scalar: one value when all rows share a mode, else [1, N, 1]."""
        modes = {row.mode for row in batch.rows}
        if modes == {Mode.ENCODE}:
            return self.encoder_layer_scalar
        if modes == {Mode.DECODE}:
            return self.decoder_layer_scalar
        enc, dec = self.encoder_layer_scalar, self.decoder_layer_scalar
        parts = [(enc if r.mode is Mode.ENCODE else dec).expand(r.num_tokens) for r in batch.rows]
        return torch.cat(parts)[None, :, None]


class SelfConditioning(GeGLU):
    """Gated MLP over the previous step's soft embeddings, added to the canvas embeddings."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps
        _norm_weight(self, "pre_norm", cfg.hidden_size)

    def condition(
        self, embeds: torch.Tensor, soft_embeds: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        ops = kernels.ops(embeds.device.type)
        signal = self(ops.rms_norm(soft_embeds, self.pre_norm.weight, self.eps), segments)
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
