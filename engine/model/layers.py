"""Building blocks shared by every backbone: RoPE, attention over the KV cache (the cache runs
the bound kernel set's paged canvas attention over all rows at once), gated MLPs, the
self-conditioning block. Modules that call kernels hold `self.kernels`, bound once at load
(`DiffusionLM.bind_kernels`)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import LayerSpec, RopeSpec, TextConfig
from engine.model.kv_cache import ForwardBatch, KVCache
from engine.model.quant import scale_of
from kernels import KernelSet, resolve_kernels
from kernels.reference import apply_rope_fused
from kernels.reference_fp8 import Fp8Rows
from kernels.reference_layer import ACTIVATIONS

# Until `DiffusionLM.bind_kernels` runs (load_model does): fast numerics, the PyTorch twins.
UNBOUND = resolve_kernels("cpu", "twins", exact=False)


def project(
    kernels: KernelSet, proj: nn.Module, x: torch.Tensor | Fp8Rows, segments: list[int]
) -> torch.Tensor:
    """x @ proj.weight^T through the bound kernels: `fp8_linear` with the weight's per-channel
    scale where the weight is FP8 (`engine.model.quant`), `fp8_linear_rows` where x is FP8
    rows already (`takes_fp8_rows`), `linear` otherwise."""
    scale = scale_of(proj, "weight")
    if isinstance(x, Fp8Rows):
        assert scale is not None and kernels.fp8_linear_rows is not None, "FP8 rows need both"
        return kernels.fp8_linear_rows(x.values, x.scale, proj.weight, scale, x.dtype)
    if scale is None:
        return kernels.linear(x, proj.weight, segments)
    return kernels.fp8_linear(x, proj.weight, scale, segments)


def takes_fp8_rows(kernels: KernelSet, *projections: nn.Module | None) -> bool:
    """Whether the kernel before these projections (which share its output) emits FP8 rows for
    them: the set has the FP8-rows kernels (sm_90) and every projection's weight is FP8. Asked
    when kernels are bound (`DiffusionLM.bind_kernels`), never per forward."""
    present = [p for p in projections if p is not None]
    return kernels.fp8_rows and all(scale_of(p, "weight") is not None for p in present)


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


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension through the bound kernel set, with a weight used as is
    (Gemma's convention) or, with `with_weight=False`, none (the self-conditioning post-norm)."""

    def __init__(self, dim: int, eps: float, with_weight: bool = True) -> None:
        super().__init__()
        self.kernels = UNBOUND
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | Fp8Rows:
        """The norm of x; `fp8`: as FP8 rows with per-token scales (`rms_norm_fp8`)."""
        if fp8:
            assert self.kernels.rms_norm_fp8 is not None, "fp8 needs the FP8-rows kernels"
            return Fp8Rows(*self.kernels.rms_norm_fp8(x, self.weight, self.eps), x.dtype)
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    FP8_PARAMS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")

    def __init__(self, cfg: TextConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.kernels = UNBOUND
        self.spec = spec
        hidden, num_heads = cfg.hidden_size, cfg.num_heads
        self.q_proj = nn.Linear(hidden, num_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = (
            nn.Linear(hidden, spec.num_kv_heads * spec.head_dim, bias=False)
            if spec.has_v_proj
            else None
        )
        self.o_proj = nn.Linear(num_heads * spec.head_dim, hidden, bias=False)
        self.lora: nn.ModuleDict | None = None  # a decoder adapter's deltas (DECODE rows only)
        self.fp8_rows = False  # q, k and v take their input as FP8 rows (`bind`)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else spec.head_dim**-0.5
        # Gemma: weighted q/k norms and an unweighted v norm (`qkv_norm_rope` applies all three;
        # q_norm and k_norm hold the weights and eps)
        self.qkv_norm = cfg.qk_norm
        if self.qkv_norm:
            self.q_norm = RMSNorm(spec.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer: int,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """x: [1, N, H] packed tokens of all rows (FP8 rows where `fp8_rows`). Returns
        [1, N, H]."""
        ks = self.kernels
        shape = (1, x.shape[1], -1, self.spec.head_dim)
        cos, sin = rope
        q, k, v = self._project_qkv(x, batch)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if self.qkv_norm:  # the norms and RoPE of q, k and v in one call (one Triton kernel)
            weights = (self.q_norm.weight, self.k_norm.weight)
            q, k, v = ks.qkv_norm_rope(q[0], k[0], v[0], *weights, cos[0], sin[0], self.q_norm.eps)
        else:
            q = apply_rope_fused(q, cos, sin)[0]  # [N, Hq, D]
            k = apply_rope_fused(k, cos, sin)[0]  # [N, Hkv, D]
            v = v[0]
        window = batch.sliding_window if self.spec.is_sliding else 0
        out = cache.attend(ks, layer, q, k, v, batch, window, self.scale)  # [N, Hq, D]
        return self._project("o_proj", out.reshape(1, x.shape[1], -1), batch)

    def _project_qkv(
        self, x: torch.Tensor | Fp8Rows, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v; full layers of DiffusionGemma have no v_proj: V is the raw k_proj output.
        One call where the kernels project several weights at once and no adapter applies."""
        many = self.kernels.linear_many
        unquantized = isinstance(x, torch.Tensor) and scale_of(self.q_proj, "weight") is None
        if many is not None and self.lora is None and unquantized:
            projections = [self.q_proj, self.k_proj]
            projections += [self.v_proj] if self.v_proj is not None else []
            q, k, *v = many(x, [p.weight for p in projections], batch.segments)
            return q, k, v[0] if v else k
        q, k = self._project("q_proj", x, batch), self._project("k_proj", x, batch)
        return q, k, k if self.v_proj is None else self._project("v_proj", x, batch)

    def _project(self, name: str, x: torch.Tensor | Fp8Rows, batch: ForwardBatch) -> torch.Tensor:
        y = project(self.kernels, getattr(self, name), x, batch.segments)
        return y if self.lora is None else self.lora[name](x, y, batch)

    def bind(self, kernels: KernelSet) -> None:
        """Bind a kernel set; Triton's attention needs a power-of-two head_dim >= 16, so other
        layers keep the twins' attention. Decides `fp8_rows` (`layers.takes_fp8_rows`; no
        adapter: its deltas read the unquantized input)."""
        head_dim = self.spec.head_dim
        if head_dim < 16 or head_dim & (head_dim - 1):
            kernels = kernels.with_twin_attention()
        self.kernels = kernels
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.fp8_rows = self.lora is None and takes_fp8_rows(kernels, *projections)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): GeGLU (Gemma) or SwiGLU (Llama)."""

    FP8_PARAMS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.kernels = UNBOUND
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.lora: nn.ModuleDict | None = None  # a decoder adapter's deltas (DECODE rows only)
        self.fp8_rows = False  # gate and up take their input as FP8 rows (`bind`)
        self.act_fp8 = False  # the gated activation emits FP8 rows for down (`bind`)

    def bind(self, kernels: KernelSet) -> None:
        """Bind a kernel set and decide where FP8 rows flow (`layers.takes_fp8_rows`): into
        gate and up (no adapter: its deltas read the unquantized input), out of the gated
        activation into down."""
        self.kernels = kernels
        self.fp8_rows = self.lora is None and takes_fp8_rows(kernels, self.gate_proj, self.up_proj)
        self.act_fp8 = kernels.gated_act_fp8 is not None and takes_fp8_rows(kernels, self.down_proj)

    def forward(
        self, x: torch.Tensor | Fp8Rows, segments: list[int], batch: ForwardBatch | None = None
    ) -> torch.Tensor:
        """`batch` (the forward's rows) is needed only when an adapter is attached; x is FP8
        rows only where `fp8_rows`."""
        ks = self.kernels
        gated_linear = ks.gated_linear if scale_of(self.gate_proj, "weight") is None else None
        gate_proj, up_proj, down_proj = self.gate_proj, self.up_proj, self.down_proj
        if self.lora is None or batch is None:
            hidden: torch.Tensor | Fp8Rows
            if gated_linear is not None and isinstance(x, torch.Tensor):  # one call
                weights = (gate_proj.weight, up_proj.weight)
                hidden = gated_linear(x, *weights, self.activation, segments)
            else:
                gate = project(ks, gate_proj, x, segments)
                up = project(ks, up_proj, x, segments)
                if self.act_fp8:
                    assert ks.gated_act_fp8 is not None, "decided at bind"
                    hidden = Fp8Rows(*ks.gated_act_fp8(gate, up, self.activation), gate.dtype)
                else:
                    hidden = ks.gated_act(gate, up, self.activation)  # act(gate) * up
            return project(ks, down_proj, hidden, segments)
        assert isinstance(x, torch.Tensor), "an adapter reads the unquantized input"
        lora = self.lora
        gate = self.act(lora["gate_proj"](x, project(ks, gate_proj, x, segments), batch))
        up = lora["up_proj"](x, project(ks, up_proj, x, segments), batch)
        hidden = gate * up
        return lora["down_proj"](hidden, project(ks, down_proj, hidden, segments), batch)


class SelfConditioning(GatedMLP):
    """Gated MLP over the previous step's soft embeddings, added to the canvas embeddings
    (then RMS-normed without weight in DiffusionGemma; left as is in converted backbones, whose
    decoder starts as the bidirectional encoder)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        self.pre_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norm = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_weight=False)
            if cfg.sc_post_norm
            else None
        )

    def condition(
        self, embeds: torch.Tensor, soft_embeds: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        signal = self(self.pre_norm(soft_embeds, fp8=self.fp8_rows), segments)
        return self.post_norm(embeds + signal) if self.post_norm is not None else embeds + signal
