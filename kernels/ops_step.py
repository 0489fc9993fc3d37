"""The step's other kernels as `torch.library` custom ops, beside `kernels.ops` (KV write,
attention): the norm `canvas::rms_norm`, attention's q/k/v norms and RoPE
`canvas::qkv_norm_rope`, the head's `canvas::softcap`, the router
`canvas::route_experts`, the experts `canvas::fused_moe`, and the sampler's
`canvas::fused_sample`, `canvas::entropy_accept`, `canvas::soft_embedding`,
`canvas::sample_and_embed` and `canvas::philox_uniform`. With them a fast-numerics step
(forward, head, sampler) runs on the meta device without a graph break;
`KernelSet.with_custom_ops()` binds them.

Implementations: the fast-numerics twins on the CPU (the experts' scattered combine, the fused
norm), Triton's launchers on CUDA (`kernels.op_support.cuda_impl`). A sampler op returns its
`reference.SampleResult` as four tensors; the wrappers below rebuild it.
"""

from __future__ import annotations

from typing import Any

import torch

import kernels.reference as reference
from kernels.op_support import cuda_impl, fake, fake_sample
from kernels.reference import SampleResult

Tensors4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Tensors5 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _fields(result: SampleResult) -> Tensors4:
    return result.sample, result.argmax, result.entropy, result.lse


# -- norm and head ---------------------------------------------------------------------------


@torch.library.custom_op("canvas::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return reference.rms_norm_fused(x, weight, eps)


@_rms_norm.register_kernel("cuda")
def _rms_norm_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_norm", "rms_norm")(*args)  # type: ignore[operator]


@_rms_norm.register_fake
def _rms_norm_fake(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(x, x.shape)


@torch.library.custom_op("canvas::qkv_norm_rope", mutates_args=())
def _qkv_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.qkv_norm_rope(q, k, v, q_weight, k_weight, cos, sin, eps)


@_qkv_norm_rope.register_kernel("cuda")
def _qkv_norm_rope_cuda(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cuda_impl("triton_norm", "qkv_norm_rope")(*args)  # type: ignore[operator]


@_qkv_norm_rope.register_fake
def _qkv_norm_rope_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fake(q, q.shape), fake(k, k.shape), fake(v, v.shape)


@torch.library.custom_op("canvas::softcap", mutates_args=())
def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    # The twin caps fp32 logits in place; an op's output may not alias its input.
    return reference.softcap(logits.clone() if logits.dtype == torch.float32 else logits, cap)


@_softcap.register_kernel("cuda")
def _softcap_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_norm", "softcap")(*args)  # type: ignore[operator]


@_softcap.register_fake
def _softcap_fake(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return fake(logits, logits.shape, torch.float32)


# -- router and experts ----------------------------------------------------------------------


@torch.library.custom_op("canvas::route_experts", mutates_args=())
def _route_experts(
    hidden: torch.Tensor,
    scale: torch.Tensor,
    proj: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.route_experts(hidden, scale, proj, per_expert_scale, top_k, eps)


@_route_experts.register_kernel("cuda")
def _route_experts_cuda(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return cuda_impl("triton_moe", "route_experts")(*args)  # type: ignore[operator]


@_route_experts.register_fake
def _route_experts_fake(hidden: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = args[3]
    shape = (hidden.shape[0], top_k)
    return fake(hidden, shape, torch.float32), fake(hidden, shape, torch.int64)


@torch.library.custom_op("canvas::fused_moe", mutates_args=())
def _fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    return reference.fused_moe_scattered(hidden, gate_up, down, weights, ids)


@_fused_moe.register_kernel("cuda")
def _fused_moe_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_moe", "fused_moe")(*args)  # type: ignore[operator]


@_fused_moe.register_fake
def _fused_moe_fake(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return fake(hidden, hidden.shape)


# -- sampler ---------------------------------------------------------------------------------


@torch.library.custom_op("canvas::fused_sample", mutates_args=())
def _fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> Tensors4:
    return _fields(reference.fused_sample(logits, temperature, uniform))


@_fused_sample.register_kernel("cuda")
def _fused_sample_cuda(*args: Any) -> Tensors4:
    return _fields(cuda_impl("triton_sampler", "fused_sample")(*args))  # type: ignore[operator]


@_fused_sample.register_fake
def _fused_sample_fake(logits: torch.Tensor, *args: Any) -> Tensors4:
    return fake_sample(logits)  # type: ignore[return-value]


@torch.library.custom_op("canvas::entropy_accept", mutates_args=())
def _entropy_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    return reference.entropy_accept(entropy, bound)


@_entropy_accept.register_kernel("cuda")
def _entropy_accept_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_sampler", "entropy_accept")(*args)  # type: ignore[operator]


@_entropy_accept.register_fake
def _entropy_accept_fake(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    return fake(entropy, entropy.shape, torch.bool)


@torch.library.custom_op("canvas::soft_embedding", mutates_args=())
def _soft_embedding(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return reference.soft_embedding(logits, temperature, lse, weight, scale)


@_soft_embedding.register_kernel("cuda")
def _soft_embedding_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_sampler", "soft_embedding")(*args)  # type: ignore[operator]


@_soft_embedding.register_fake
def _soft_embedding_fake(logits: torch.Tensor, *args: Any) -> torch.Tensor:
    weight = args[2]
    return fake(weight, (logits.shape[0], weight.shape[1]))


@torch.library.custom_op("canvas::sample_and_embed", mutates_args=())
def _sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> Tensors5:
    result, soft = reference.sample_and_embed(logits, temperature, uniform, weight, scale)
    return (*_fields(result), soft)


@_sample_and_embed.register_kernel("cuda")
def _sample_and_embed_cuda(*args: Any) -> Tensors5:
    result, soft = cuda_impl("triton_sampler", "sample_and_embed")(*args)  # type: ignore[operator]
    return (*_fields(result), soft)


@_sample_and_embed.register_fake
def _sample_and_embed_fake(logits: torch.Tensor, *args: Any) -> Tensors5:
    weight = args[2]
    return (*fake_sample(logits), fake(weight, (logits.shape[0], weight.shape[1])))  # type: ignore[return-value]


@torch.library.custom_op("canvas::philox_uniform", mutates_args=())
def _philox_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return reference.philox_uniform(seeds, counters)


@_philox_uniform.register_kernel("cuda")
def _philox_uniform_cuda(*args: Any) -> torch.Tensor:
    return cuda_impl("triton_sampler", "philox_uniform")(*args)  # type: ignore[operator]


@_philox_uniform.register_fake
def _philox_uniform_fake(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    return fake(counters, torch.broadcast_shapes(seeds.shape, counters.shape), torch.float32)


# -- the wrappers KernelSet binds (the twins' signatures) ------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.rms_norm_fused` as `canvas::rms_norm`."""
    return torch.ops.canvas.rms_norm(x, weight, eps)


def qkv_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.qkv_norm_rope` as `canvas::qkv_norm_rope`."""
    return torch.ops.canvas.qkv_norm_rope(q, k, v, q_weight, k_weight, cos, sin, eps)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`reference.softcap` as `canvas::softcap` (a new tensor, never in place)."""
    return torch.ops.canvas.softcap(logits, cap)


def philox_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """`reference.philox_uniform` as `canvas::philox_uniform`."""
    return torch.ops.canvas.philox_uniform(seeds, counters)


def route_experts(
    hidden: torch.Tensor,
    scale: torch.Tensor,
    proj: torch.Tensor,
    per_expert_scale: torch.Tensor,
    top_k: int,
    eps: float,
    segments: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route_experts` as `canvas::route_experts` (`segments` ignored: fast)."""
    return torch.ops.canvas.route_experts(hidden, scale, proj, per_expert_scale, top_k, eps)


def fused_moe(
    hidden: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """`reference.fused_moe_scattered` as `canvas::fused_moe` (`segments` ignored: fast)."""
    return torch.ops.canvas.fused_moe(hidden, gate_up, down, weights, ids)


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> SampleResult:
    """`reference.fused_sample` as `canvas::fused_sample`."""
    return SampleResult(*torch.ops.canvas.fused_sample(logits, temperature, uniform))


def entropy_accept(entropy: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """`reference.entropy_accept` as `canvas::entropy_accept`."""
    return torch.ops.canvas.entropy_accept(entropy, bound)


def soft_embedding(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    lse: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`reference.soft_embedding` as `canvas::soft_embedding`."""
    return torch.ops.canvas.soft_embedding(logits, temperature, lse, weight, scale)


def sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> tuple[SampleResult, torch.Tensor]:
    """`reference.sample_and_embed` as `canvas::sample_and_embed`."""
    *fields, soft = torch.ops.canvas.sample_and_embed(logits, temperature, uniform, weight, scale)
    return SampleResult(*fields), soft
