"""DiffusionGemma's layer: attention with q/k/v norms (k_eq_v on full layers), then a dense
GeGLU MLP and a mixture-of-experts branch side by side, with Gemma's sandwich norms and a
per-mode layer scalar (`encoder_layer_scalar`, `decoder_layer_scalar`: separate buffers in the
checkpoint, the only weights that differ between the two modes)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.base import DiffusionLM
from engine.model.config import LayerSpec, TextConfig, parse_text_config
from engine.model.kv_cache import ForwardBatch, KVCache, Mode
from engine.model.layers import UNBOUND, Attention, GatedMLP, RMSNorm
from engine.model.quant import scale_of
from kernels import KernelSet
from kernels.reference_fp8 import Fp8Rows


class Router(nn.Module):
    """The MoE router's weights (`router.proj.weight`, `router.scale`, `per_expert_scale`)."""

    scale: nn.Parameter
    per_expert_scale: nn.Parameter

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))


class Experts(nn.Module):
    """Every expert's fused gate/up [E, 2I, H] and down [E, H, I] projections, FP8 with
    per-expert, per-channel scales (`gate_up_proj_scale` [E, 2I, 1], `down_proj_scale`
    [E, H, 1]) when `engine.model.quant` made them so."""

    FP8_PARAMS = ("gate_up_proj", "down_proj")
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter))


class Layer(nn.Module):
    """Attention, then the dense GeGLU MLP and the MoE branch side by side."""

    kernels: KernelSet
    encoder_layer_scalar: torch.Tensor
    decoder_layer_scalar: torch.Tensor
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm_1: RMSNorm
    post_feedforward_layernorm_2: RMSNorm
    pre_feedforward_layernorm_2: RMSNorm

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
        self.kernels = UNBOUND
        self.self_attn = Attention(cfg, spec)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        for name in self.NORMS:
            self.add_module(name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))
        self.router = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        # Buffers in the checkpoint (not tied between the modes, not trained).
        self.register_buffer("encoder_layer_scalar", torch.ones(1))
        self.register_buffer("decoder_layer_scalar", torch.ones(1))
        self.experts_fp8 = False  # both expert weights are FP8 (`bind`)
        self.pre_feedforward_fp8 = False  # the pre-feedforward norms emit FP8 rows (`bind`)

    def bind(self, kernels: KernelSet) -> None:
        """Bind a kernel set (its parts bound first: `DiffusionLM.bind_kernels`) and decide
        whether both expert weights are FP8 (`engine.model.quant`), and whether the
        pre-feedforward norms emit FP8 rows: where the dense MLP and the experts both take them."""
        self.kernels = kernels
        experts = self.experts
        scales = (scale_of(experts, "gate_up_proj"), scale_of(experts, "down_proj"))
        self.experts_fp8 = None not in scales
        fp8_moe = kernels.fp8_moe_rows is not None and self.experts_fp8
        both = fp8_moe and self.mlp.fp8_rows and kernels.rms_norm_pair_fp8 is not None
        self.pre_feedforward_fp8 = both

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        ops, eps = self.kernels, self.cfg.rms_norm_eps
        normed = self.input_layernorm(x, fp8=self.self_attn.fp8_rows)
        h = self.self_attn(normed, rope, layer, batch, cache)
        # x + post_attention_layernorm(h)
        x = ops.add_rms_norm(x, h, self.post_attention_layernorm.weight, eps)

        residual = x
        seg = batch.segments
        pre_dense, pre_moe = self.pre_feedforward(x)
        dense = self.mlp(pre_dense, seg, batch)
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = ops.route_experts(
            flat,
            self.router.scale,
            self.router.proj.weight,
            self.router.per_expert_scale,
            self.cfg.top_k_experts,
            self.cfg.rms_norm_eps,
            segments=seg,
        )
        moe = self.run_experts(pre_moe.reshape(flat.shape), weights, ids, seg)
        # (residual + post_feedforward_layernorm(post_feedforward_layernorm_1(dense) +
        # post_feedforward_layernorm_2(moe))) * layer scalar
        return ops.close_layer(
            dense,
            moe.reshape(x.shape),
            residual,
            self.post_feedforward_layernorm_1.weight,
            self.post_feedforward_layernorm_2.weight,
            self.post_feedforward_layernorm.weight,
            self.layer_scalar(batch),
            eps,
        )

    def pre_feedforward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor | Fp8Rows]:
        """pre_feedforward_layernorm(x) and pre_feedforward_layernorm_2(x), one read of x: as
        FP8 rows where `pre_feedforward_fp8` (`rms_norm_pair_fp8`)."""
        ops, eps = self.kernels, self.cfg.rms_norm_eps
        weights = (self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm_2.weight)
        if not self.pre_feedforward_fp8:
            return ops.rms_norm_pair(x, *weights, eps)
        assert ops.rms_norm_pair_fp8 is not None, "decided at bind"
        q_dense, s_dense, q_moe, s_moe = ops.rms_norm_pair_fp8(x, *weights, eps)
        return Fp8Rows(q_dense, s_dense, x.dtype), Fp8Rows(q_moe, s_moe, x.dtype)

    def run_experts(
        self,
        x: torch.Tensor | Fp8Rows,
        weights: torch.Tensor,
        ids: torch.Tensor,
        segments: list[int],
    ) -> torch.Tensor:
        """The experts over x [N, H]: `fp8_moe` with their scales where they are FP8,
        `fp8_moe_rows` where x is FP8 rows too."""
        experts, ops = self.experts, self.kernels
        gate_up_scale = scale_of(experts, "gate_up_proj")
        down_scale = scale_of(experts, "down_proj")
        if isinstance(x, Fp8Rows):
            assert ops.fp8_moe_rows is not None and self.experts_fp8, "FP8 rows need both"
            return ops.fp8_moe_rows(
                x.values, x.scale, experts.gate_up_proj, gate_up_scale, experts.down_proj,
                down_scale, weights, ids, x.dtype, segments=segments,
            )  # fmt: skip
        if gate_up_scale is None or down_scale is None:
            return ops.fused_moe(
                x, experts.gate_up_proj, experts.down_proj, weights, ids, segments=segments
            )
        return ops.fp8_moe(
            x, experts.gate_up_proj, gate_up_scale, experts.down_proj, down_scale, weights, ids,
            segments=segments,
        )  # fmt: skip

    def layer_scalar(self, batch: ForwardBatch) -> torch.Tensor:
        """The per-mode layer scalar: one value when all rows share a mode, else [1, N, 1]."""
        modes = {row.mode for row in batch.rows}
        if modes == {Mode.ENCODE}:
            return self.encoder_layer_scalar
        if modes == {Mode.DECODE}:
            return self.decoder_layer_scalar
        decode = batch.decode_tokens(self.decoder_layer_scalar.device)
        return torch.where(decode, self.decoder_layer_scalar, self.encoder_layer_scalar)[
            None, :, None
        ]


class DiffusionGemma(DiffusionLM):
    """The DiffusionGemma (Gemma 4 MoE) text stack."""

    parse_text_config = staticmethod(parse_text_config)

    def make_layer(self, cfg: TextConfig, spec: LayerSpec) -> nn.Module:
        return Layer(cfg, spec)
