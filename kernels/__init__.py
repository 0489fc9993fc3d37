"""Canvas kernels. `kernels.reference` holds the PyTorch twin of every kernel; the Triton
versions (CUDA) have the same names and signatures. `resolve_kernels()` picks, once at load,
the `KernelSet` an engine runs with — a backend (Triton kernels or the twins) and a numerics
(fast or exact) — and the model binds it onto its modules; nothing on the hot path reads the
environment. Triton is imported lazily, so CPU-only installs import this package without it."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch

from kernels import reference

# Each module exports KERNELS: its launchers, named exactly as their twins in `reference`.
TRITON_MODULES = (
    "kernels.triton_attention",
    "kernels.triton_layer",
    "kernels.triton_moe",
    "kernels.triton_norm",
    "kernels.triton_sampler",
)
BACKENDS = ("auto", "triton", "twins")


def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as absent
        return False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


@functools.cache
def triton_ops() -> ModuleType:
    """The Triton implementations (twins where none exists), whatever the device: CUDA engines
    bind them; tests and the benchmark's dry run use them under TRITON_INTERPRET=1 on CPU."""
    module = ModuleType("kernels.triton_ops", "Triton kernels, twins where none exists.")
    public = {k: v for k, v in vars(reference).items() if not k.startswith("_")}
    module.__dict__.update(public)
    for name in TRITON_MODULES:
        for launcher in importlib.import_module(name).KERNELS:
            assert launcher.__name__ in public, f"{name}.{launcher.__name__} has no twin"
            setattr(module, launcher.__name__, launcher)
    return module


def _batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` over all tokens of a step at once: the per-request `segments` are dropped."""

    @functools.wraps(fn)
    def call(*args: Any, segments: list[int] | None = None) -> Any:
        return fn(*args)

    return call


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

    backend: str  # "triton" | "twins"
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
    # A gated MLP's act(x @ gate^T) * (x @ up^T) in one call (`native_moe.gated_linear`); None:
    # `linear` twice and `gated_act`.
    gated_linear: Callable[..., torch.Tensor] | None = None
    # Several projections of one input (attention's q, k, v) in one call
    # (`native_moe.linear_many`); None: `linear` for each.
    linear_many: Callable[..., list[torch.Tensor]] | None = None
    # The sampler and the norms are `kernels.native_cpu`'s C kernels (CPU, fast numerics).
    native: bool = False

    @property
    def numerics(self) -> str:
        return "exact" if self.exact else "fast"

    def describe(self) -> str:
        native = ", native CPU sampler, norms and experts" if self.native else ""
        return f"{self.numerics} numerics, {self.backend} kernels{native}"

    def with_twin_attention(self) -> KernelSet:
        """This set with the twins' attention and KV writes (for head dims Triton lacks)."""
        attend = reference.canvas_attention_rowwise if self.exact else reference.canvas_attention
        return replace(self, write_kv=reference.write_kv, canvas_attention=attend)

    def with_custom_ops(self) -> KernelSet:
        """This set with every kernel as a `torch.library` custom op (`kernels.ops`: the KV
        write and attention; `kernels.ops_layer`: a layer's fused norm tails and MLP product;
        `kernels.ops_step`: norms, q/k/v norms and RoPE, softcap, router,
        experts, sampler, random numbers), so that a step runs on the meta device and traces
        through them. Fast numerics only: the ops' CPU implementations are the batched twins."""
        if self.exact:
            raise ValueError("custom ops carry fast numerics only (the batched twins)")
        from kernels import ops, ops_layer, ops_step

        return replace(
            self,
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
            fused_sample=ops_step.fused_sample,
            entropy_accept=ops_step.entropy_accept,
            soft_embedding=ops_step.soft_embedding,
            sample_and_embed=ops_step.sample_and_embed,
            gated_linear=None,
            linear_many=None,
            native=False,
        )


def resolve_kernels(device_type: str, backend: str = "auto", exact: bool = False) -> KernelSet:
    """The kernel set for a device type ("cpu", "cuda"). backend "auto": Triton on CUDA when
    triton is installed, else the twins, and on CPU in fast numerics the native C sampler and
    norms where this machine can build them (`kernels.native_cpu`); "triton" everywhere it is
    asked for (on CPU only under TRITON_INTERPRET=1: tests); "twins": the PyTorch twins only."""
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device_type == "cuda" and triton_available() else "twins"
        if device_type == "cpu" and not exact:
            kernels = resolve_kernels(device_type, backend, exact)
            return _with_native(kernels) if backend == "twins" else kernels
    if backend == "triton" and not triton_available():
        raise ValueError("kernel backend 'triton' needs the triton package (pip install triton)")
    ops: Any = triton_ops() if backend == "triton" else reference
    if exact:
        # Triton's router, experts and attention are batch invariant by construction; the
        # twins keep the reference's per-request order.
        return KernelSet(
            backend=backend,
            exact=True,
            rms_norm=reference.rms_norm,
            add_rms_norm=reference.add_rms_norm_exact,
            rms_norm_pair=reference.rms_norm_pair_exact,
            close_layer=reference.close_layer_exact,
            gated_act=reference.gated_act,
            qkv_norm_rope=reference.qkv_norm_rope_exact,
            softcap=reference.softcap,
            linear=reference.segment_linear,
            route_experts=ops.route_experts,
            fused_moe=ops.fused_moe,
            write_kv=ops.write_kv,
            canvas_attention=(
                ops.canvas_attention if backend == "triton" else reference.canvas_attention_rowwise
            ),
            fused_sample=ops.fused_sample,
            entropy_accept=ops.entropy_accept,
            soft_embedding=ops.soft_embedding,
            sample_and_embed=ops.sample_and_embed,
            philox_uniform=ops.philox_uniform,
        )
    return KernelSet(
        backend=backend,
        exact=False,
        # Triton's norm is one pass (the twin's fp32 operations are six on a GPU).
        rms_norm=ops.rms_norm if backend == "triton" else reference.rms_norm_fused,
        # Triton: a layer's norms, residual adds, layer scalar and MLP product in 4 launches
        # (unfused: 16); the twins run the same ops in the layer's order.
        add_rms_norm=ops.add_rms_norm,
        rms_norm_pair=ops.rms_norm_pair,
        close_layer=ops.close_layer,
        gated_act=ops.gated_act,
        # Triton: attention's q/k/v norms and RoPE in one kernel (the twin's are ~15 passes).
        qkv_norm_rope=ops.qkv_norm_rope,
        softcap=ops.softcap,
        linear=reference.linear,
        route_experts=_batched(ops.route_experts),
        # The twins' scattered combine; Triton's kernel is batched already.
        fused_moe=(
            _batched(ops.fused_moe) if backend == "triton" else reference.fused_moe_scattered
        ),
        write_kv=ops.write_kv,
        canvas_attention=ops.canvas_attention,
        fused_sample=ops.fused_sample,
        entropy_accept=ops.entropy_accept,
        soft_embedding=ops.soft_embedding,
        sample_and_embed=ops.sample_and_embed,
        philox_uniform=ops.philox_uniform,
    )


def _with_native(kernels: KernelSet) -> KernelSet:
    """`kernels` with the native CPU sampler, norms, router and one-token experts bound, when
    this machine builds them."""
    from kernels import native_attention, native_cpu, native_moe, native_step

    if not native_cpu.available():
        return kernels
    return replace(
        kernels,
        rms_norm=native_cpu.rms_norm,
        add_rms_norm=native_cpu.add_rms_norm,
        rms_norm_pair=native_cpu.rms_norm_pair,
        close_layer=native_cpu.close_layer,
        qkv_norm_rope=native_step.qkv_norm_rope,
        route_experts=native_step.route_experts,
        gated_act=native_step.gated_act,
        fused_moe=native_moe.fused_moe,
        linear=native_moe.linear,
        gated_linear=native_moe.gated_linear,
        linear_many=native_moe.linear_many,
        canvas_attention=native_attention.canvas_attention,
        fused_sample=native_cpu.fused_sample,
        sample_and_embed=native_cpu.sample_and_embed,
        philox_uniform=native_step.philox_uniform,
        native=True,
    )


def expect(
    tensor: torch.Tensor,
    name: str,
    shape: Sequence[int | None],
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> None:
    """Launcher check: rank, sizes (None = any), dtype, device, and a unit stride in the last
    dimension (the kernels address rows through strides but read each row as one vector)."""
    assert tensor.dim() == len(shape), f"{name}: expected {len(shape)} dims, got {tensor.dim()}"
    for dim, (want, got) in enumerate(zip(shape, tensor.shape, strict=True)):
        assert want is None or want == got, f"{name}: dim {dim} is {got}, expected {want}"
    assert tensor.dtype in dtypes, f"{name}: dtype {tensor.dtype}, expected one of {dtypes}"
    assert tensor.device == device, f"{name}: on {tensor.device}, expected {device}"
    assert tensor.shape[-1] <= 1 or tensor.stride(-1) == 1, f"{name}: last dim must be contiguous"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in full precision (parity with the twins); the default TF32 would
    lose ~3 decimal digits. bf16/fp16 operands ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


__all__ = [
    "BACKENDS",
    "KernelSet",
    "dot_precision",
    "expect",
    "interpreting",
    "reference",
    "resolve_kernels",
    "triton_available",
    "triton_ops",
]
