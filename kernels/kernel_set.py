"""`KernelSet`: the kernels one engine runs, a record of callables chosen once by a backend
(`kernels.backends`) and bound onto the model's modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

import kernels.reference as reference


@dataclass(frozen=True, slots=True)
class KernelSet:
    """The kernels one engine runs, chosen once (`resolve_kernels`) and bound onto the model.

    `exact`: reference-exact numerics — per-request GEMMs below `reference.SMALL_ROWS` rows,
    experts grouped per request, attention one row at a time in the reference's order, so a
    request's values never depend on its batch and match transformers bit for bit on CPU.
    Fast numerics: one GEMM per projection over all rows, experts grouped over all tokens, one
    attention call over all rows. Every callable takes the same arguments in both numerics
    (`segments`, rows per request, is ignored where batching needs no per-request split).
    """

    backend: str  # a name of `kernels.backends.REGISTRY`: "twins" | "native" | "triton" | ...
    exact: bool
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]
    rms_norm_pair: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    close_layer: Callable[..., torch.Tensor]
    gated_act: Callable[..., torch.Tensor]
    qkv_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    softcap: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]
    route_experts: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]
    canvas_attention: Callable[..., torch.Tensor]
    fused_sample: Callable[..., reference.SampleResult]
    entropy_accept: Callable[..., torch.Tensor]
    soft_embedding: Callable[..., torch.Tensor]
    sample_and_embed: Callable[..., tuple[reference.SampleResult, torch.Tensor]]
    philox_uniform: Callable[..., torch.Tensor]
    # Dense projections and experts over FP8 weights with per-channel scales: the twins
    # (`kernels.reference_fp8`) dequantize and run the unquantized path; Triton binds its FP8
    # expert GEMM, and `torch._scaled_mm` projections on sm_90 (`kernels.triton_fp8`).
    fp8_linear: Callable[..., torch.Tensor]
    fp8_moe: Callable[..., torch.Tensor]
    # A gated MLP's act(x @ gate^T) * (x @ up^T) in one call (`kernels.native.moe`); None:
    # `linear` twice and `gated_act`.
    gated_linear: Callable[..., torch.Tensor] | None = None
    # Several projections of one input (attention's q, k, v) in one call
    # (`kernels.native.moe.linear_many`); None: `linear` for each.
    linear_many: Callable[..., list[torch.Tensor]] | None = None
    # FP8 rows (`with_fp8_rows`; Triton binds them on sm_90): the norms and the GeGLU product
    # that feed FP8 projections emit FP8 with per-token scales, which the projections and the
    # experts (FP8 x FP8) take without a quantizer launch; None: each FP8 projection quantizes
    # its own input (`fp8_linear`).
    rms_norm_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    rms_norm_pair_fp8: Callable[..., tuple[torch.Tensor, ...]] | None = None
    gated_act_fp8: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    fp8_linear_rows: Callable[..., torch.Tensor] | None = None
    fp8_moe_rows: Callable[..., torch.Tensor] | None = None
    # What makes the set one model binds, once, when it is bound (`for_model`): the native
    # backend's kernels given a store for that model's packed weights. None: this set as it is.
    prepare: Callable[[KernelSet], KernelSet] | None = None

    @property
    def native(self) -> bool:
        """Whether the native CPU kernels (`kernels.native`) are bound."""
        return self.backend == "native"

    @property
    def numerics(self) -> str:
        return "exact" if self.exact else "fast"

    def describe(self) -> str:
        return f"{self.numerics} numerics, {self.backend} kernels"

    def for_model(self) -> KernelSet:
        """The set to bind onto one model (`DiffusionLM.bind_kernels`), with whatever per-model
        state the backend keeps (its own, not shared with another model)."""
        return self if self.prepare is None else replace(self.prepare(self), prepare=None)

    @property
    def fp8_rows(self) -> bool:
        """Whether FP8 projections take FP8 rows from the kernels before them."""
        return self.fp8_linear_rows is not None

    def with_fp8_rows(self, ops: Any = reference) -> KernelSet:
        """This set with `ops`' FP8-rows kernels (`FP8_ROWS`; the twins by default: what the
        CPU tests and the roofline run of sm_90's path)."""
        return replace(self, **{name: getattr(ops, name) for name in FP8_ROWS})

    def with_twin_attention(self) -> KernelSet:
        """This set with the twins' attention and KV writes (for head dims Triton lacks)."""
        attend = reference.canvas_attention_rowwise if self.exact else reference.canvas_attention
        return replace(self, write_kv=reference.write_kv, canvas_attention=attend)

    def with_custom_ops(self) -> KernelSet:
        """This set with every kernel as a `torch.library` custom op (`kernels.ops`: the KV
        write and attention; `kernels.ops_layer`: a layer's fused norm tails and MLP product;
        `kernels.ops_step`: norms, q/k/v norms and RoPE, softcap, router, experts, sampler,
        random numbers; `kernels.ops_fp8`: FP8 projections and experts, and the FP8-rows
        kernels where this set has them), so that a step runs on the meta device and traces
        through them. Fast numerics only: the ops' CPU implementations are the batched twins."""
        if self.exact:
            raise ValueError("custom ops carry fast numerics only (the batched twins)")
        import kernels.ops as ops
        import kernels.ops_fp8 as ops_fp8
        import kernels.ops_layer as ops_layer
        import kernels.ops_step as ops_step

        return replace(
            self,
            # the ops' CPU implementations are the twins (never the native kernels)
            backend="twins" if self.backend == "native" else self.backend,
            rms_norm=ops_step.rms_norm,
            add_rms_norm=ops_layer.add_rms_norm,
            rms_norm_pair=ops_layer.rms_norm_pair,
            close_layer=ops_layer.close_layer,
            gated_act=ops_layer.gated_act,
            qkv_norm_rope=ops_step.qkv_norm_rope,
            softcap=ops_step.softcap,
            philox_uniform=ops_step.philox_uniform,
            write_kv=ops.write_kv,
            canvas_attention=ops.canvas_attention,
            route_experts=ops_step.route_experts,
            fused_moe=ops_step.fused_moe,
            fp8_linear=ops_fp8.fp8_linear,
            fp8_moe=ops_fp8.fp8_moe,
            **{
                name: getattr(ops_fp8, name) for name in FP8_ROWS if getattr(self, name) is not None
            },
            fused_sample=ops_step.fused_sample,
            entropy_accept=ops_step.entropy_accept,
            soft_embedding=ops_step.soft_embedding,
            sample_and_embed=ops_step.sample_and_embed,
            gated_linear=None,
            linear_many=None,
            prepare=None,
        )


# The fields that are kernels (every one but the backend's name, the numerics and `prepare`).
KERNELS = tuple(f.name for f in fields(KernelSet) if f.name not in ("backend", "exact", "prepare"))
# The FP8-rows kernels, bound together or not at all (`KernelSet.with_fp8_rows`).
FP8_ROWS = ("rms_norm_fp8", "rms_norm_pair_fp8", "gated_act_fp8", "fp8_linear_rows", "fp8_moe_rows")
# The kernels a backend may leave out (None: composed from the others).
OPTIONAL = ("gated_linear", "linear_many", *FP8_ROWS)
