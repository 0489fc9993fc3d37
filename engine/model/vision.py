"""DiffusionGemma's vision tower (Gemma 4's `gemma4_vision` encoder) and the projection of its
soft tokens into the text embedding space (`embed_vision`).

Images arrive as the checkpoint's image processor makes them: `pixel_values` [B, P, 3·p²]
(patches of p×p pixels in [0, 1], padded to P = max_soft_tokens·k² patches) and
`position_ids` [B, P, 2] (each patch's (x, y) in the patch grid, (-1, -1) for padding). The
tower embeds the patches (linear + learned 2-D position table), runs bidirectional encoder
layers over each image's real patches (2-D axial RoPE, q/k/v norms, GeGLU), average-pools k×k
patch groups into soft tokens scaled by sqrt(hidden), drops the padding, and `embed_vision`
norms (no weight) and projects them to the text hidden size. The encoder merges them at the
image-token positions of the prompt (`DiffusionLM.forward`).

Every operation is the reference's (`transformers.models.gemma4.modeling_gemma4`
`Gemma4VisionModel`, `Gemma4MultimodalEmbedder`) in the same order and on the same shapes, so
the features are bit for bit the reference's for the same batch of images. Parameter names are
the checkpoint's under `model.encoder.vision_tower.` (`tower.*`) and `model.encoder.embed_vision.`
(`projection.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import VisionConfig
from kernels.reference import rms_norm  # Gemma 4's RMSNorm, the reference's operations


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float, with_weight: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class ClippableLinear(nn.Module):
    """A bias-free linear layer (`*.linear.weight`), its input and output clamped to stored
    bounds when the checkpoint says `use_clipped_linears`."""

    input_min: torch.Tensor
    input_max: torch.Tensor
    output_min: torch.Tensor
    output_max: torch.Tensor

    def __init__(self, cfg: VisionConfig, in_features: int, out_features: int) -> None:
        super().__init__()
        self.clipped = cfg.use_clipped_linears
        self.linear = nn.Linear(in_features, out_features, bias=False)
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                inf = float("inf") if name.endswith("max") else -float("inf")
                self.register_buffer(name, torch.tensor(inf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = self.linear(x)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, P, H, D]; cos, sin [B, P, D]: the first half of D rotates by the patch's x, the
    second by its y (the reference's `apply_multidimensional_rope` with two dimensions)."""
    half = 2 * (x.shape[-1] // 4)
    parts = []
    for xp, c, s in zip(x.split(half, -1), cos.split(half, -1), sin.split(half, -1), strict=True):
        c, s = c.unsqueeze(2), s.unsqueeze(2)
        parts.append((xp * c) + (rotate_half(xp) * s))
    return torch.cat(parts, dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden, dim = cfg.hidden_size, cfg.head_dim
        self.q_proj = ClippableLinear(cfg, hidden, cfg.num_heads * dim)
        self.k_proj = ClippableLinear(cfg, hidden, cfg.num_kv_heads * dim)
        self.v_proj = ClippableLinear(cfg, hidden, cfg.num_kv_heads * dim)
        self.o_proj = ClippableLinear(cfg, cfg.num_heads * dim, hidden)
        self.q_norm = Norm(dim, cfg.rms_norm_eps)
        self.k_norm = Norm(dim, cfg.rms_norm_eps)
        self.v_norm = Norm(dim, cfg.rms_norm_eps, with_weight=False)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """x [B, P, Hv]; mask [B, 1, P, P] bool (True = attend) or None (no padding)."""
        shape = (*x.shape[:-1], -1, self.cfg.head_dim)
        cos, sin = rope
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(shape)).transpose(1, 2)
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        gqa = groups > 1 and mask is None and self.cfg.head_dim <= 256
        if groups > 1 and not gqa:  # the reference repeats KV heads when it has a mask
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        kwargs = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, scale=1.0, is_causal=False, **kwargs
        )  # [B, Hq, P, D]
        out = out.transpose(1, 2).contiguous().reshape(*x.shape[:-1], -1).contiguous()
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class EncoderLayer(nn.Module):
    input_layernorm: Norm
    post_attention_layernorm: Norm
    pre_feedforward_layernorm: Norm
    post_feedforward_layernorm: Norm
    NORMS = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    )

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        for name in self.NORMS:
            self.add_module(name, Norm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, mask)
        x = x + self.post_attention_layernorm(h)
        h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + h


class PatchEmbedder(nn.Module):
    position_embedding_table: nn.Parameter

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, cfg.position_embedding_size, cfg.hidden_size)
        )

    def forward(
        self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor
    ) -> torch.Tensor:
        pixels = 2 * (pixels - 0.5)  # Gemma 4 takes pixels in [0, 1] and scales them here
        hidden = self.input_proj(pixels.to(self.input_proj.weight.dtype))
        clamped = positions.clamp(min=0)
        table = self.position_embedding_table
        emb = F.embedding(clamped[..., 0], table[0]) + F.embedding(clamped[..., 1], table[1])
        return hidden + torch.where(padding.unsqueeze(-1), 0.0, emb)


class Encoder(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.init_rope(cfg)

    def init_rope(self, cfg: VisionConfig, device: torch.device | str | None = None) -> None:
        spatial = cfg.head_dim // 2
        exponent = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        inv_freq = 1.0 / (cfg.rope_theta**exponent)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, P, D]: x's frequencies twice, then y's twice (the reference's
        H-H-W-W layout)."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, P, 2, D/4]
        cos, sin = (
            torch.cat([t[:, :, 0], t[:, :, 0], t[:, :, 1], t[:, :, 1]], dim=-1).to(dtype)
            for t in (freqs.cos() * 1.0, freqs.sin() * 1.0)
        )
        return cos, sin


class Tower(nn.Module):
    """`model.encoder.vision_tower.*`: patch embedder, encoder, the optional standardisation."""

    std_bias: torch.Tensor
    std_scale: torch.Tensor

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = Encoder(cfg)
        if cfg.standardize:
            self.register_buffer("std_bias", torch.zeros(cfg.hidden_size))
            self.register_buffer("std_scale", torch.ones(cfg.hidden_size))


class Projection(nn.Module):
    """`model.encoder.embed_vision.*`: soft tokens into the text embedding space."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(cfg.hidden_size, text_hidden_size, bias=False)


class VisionTower(nn.Module):
    """The Gemma 4 vision encoder and the `embed_vision` projection (see the module docstring).
    `forward` returns the soft tokens of a batch of images, in image order."""

    def __init__(self, cfg: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.tower = Tower(cfg)
        self.projection = Projection(cfg, text_hidden_size)

    def init_rope(self, device: torch.device | str | None = None) -> None:
        self.tower.encoder.init_rope(self.cfg, device)

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """pixels [B, P, 3·p²], positions [B, P, 2] (long; -1 = padding) →
        [sum of soft tokens, text hidden] in the embedding dtype."""
        cfg, tower = self.cfg, self.tower
        padding = (positions == -1).all(dim=-1)  # [B, P]
        x = tower.patch_embedder(pixels, positions, padding)
        mask = None
        if bool(padding.any()):  # the reference builds a mask only when something is padded
            b, p = padding.shape
            mask = (~padding)[:, None, None, :].expand(b, 1, p, p).contiguous()
        rope = tower.encoder.rope(positions, x.dtype)
        for layer in tower.encoder.layers:
            x = layer(x, rope, mask)
        length = pixels.shape[-2] // cfg.pooling_kernel_size**2  # soft tokens per image
        pooled, valid = self._pool(x, positions, padding, length)
        soft = pooled[valid]
        if cfg.standardize:
            soft = (soft - tower.std_bias.float()) * tower.std_scale.float()
        soft = soft.to(x.dtype)
        normed = rms_norm(soft, None, cfg.rms_norm_eps)
        return self.projection.embedding_projection(normed)

    def _pool(
        self, x: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Average k×k patch groups by their grid positions into `length` soft tokens, scaled
        by sqrt(hidden) in fp32: ([B, length, Hv] fp32, [B, length] valid)."""
        x = x.masked_fill(padding.unsqueeze(-1), 0.0)
        valid = ~padding
        if x.shape[1] != length:
            k = int((x.shape[1] // length) ** 0.5)
            clamped = positions.clamp(min=0)
            max_x = clamped[..., 0].max(dim=-1, keepdim=True)[0] + 1
            kernel = torch.div(clamped, k, rounding_mode="floor")
            kernel = kernel[..., 0] + (max_x // k) * kernel[..., 1]
            weights = F.one_hot(kernel.long(), length).float() / k**2
            x = (weights.transpose(1, 2) @ x.float()).to(x.dtype)
            valid = torch.logical_not((weights == 0).all(dim=1))
        return x.float() * self.cfg.hidden_size**0.5, valid
