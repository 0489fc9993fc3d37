"""The native sampler (`sampler.c`): `reference.fused_sample` and the probabilities of
`reference.sample_and_embed` in three passes per row, where the twin makes about fifteen passes
over the [positions, vocabulary] logits (a large share of a canvas step on a CPU)."""

from __future__ import annotations

import torch

from kernels.native.args import SampleArgs
from kernels.native.build import loaded
from kernels.native.threads import MIN_ROWS_PER_THREAD, split_rows
from kernels.reference_sampler import SampleResult


def sample_into(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor, probs: torch.Tensor
) -> SampleResult:
    """`reference.fused_sample` of fp32 CPU logits [P, V], its probabilities written to
    `probs` [P, V] (fp32, contiguous)."""
    lib = loaded("sampler")
    num_positions, vocab = logits.shape
    assert logits.device.type == "cpu" and logits.dtype == torch.float32, "fp32 CPU logits"
    logits = logits.contiguous()
    temperature = temperature.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float32).contiguous()
    assert temperature.shape == (num_positions,) and uniform.shape == (num_positions,)
    result = SampleResult(
        sample=torch.empty(num_positions, dtype=torch.int64),
        argmax=torch.empty(num_positions, dtype=torch.int64),
        entropy=torch.empty(num_positions, dtype=torch.float32),
        lse=torch.empty(num_positions, dtype=torch.float32),
    )
    args = SampleArgs(
        logits=logits.data_ptr(),
        vocab=vocab,
        temperature=temperature.data_ptr(),
        uniform=uniform.data_ptr(),
        probs=probs.data_ptr(),
        sample=result.sample.data_ptr(),
        argmax=result.argmax.data_ptr(),
        entropy=result.entropy.data_ptr(),
        lse=result.lse.data_ptr(),
    )
    split_rows("sampler", lib.canvas_sample_rows, args, num_positions, MIN_ROWS_PER_THREAD)
    return result


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor
) -> SampleResult:
    """`reference.fused_sample`, natively (see `kernels.native` for the numerics)."""
    probs = torch.empty(logits.shape, dtype=torch.float32)
    return sample_into(logits, temperature, uniform, probs)


def sample_and_embed(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
) -> tuple[SampleResult, torch.Tensor]:
    """`reference.sample_and_embed`, natively: the sampler's probabilities, then one GEMM."""
    probs = torch.empty(logits.shape, dtype=torch.float32)
    result = sample_into(logits, temperature, uniform, probs)
    soft = logits.new_empty(logits.shape[0], weight.shape[1], dtype=weight.dtype)
    torch.matmul(probs.to(weight.dtype), weight, out=soft)  # the twin's GEMM call, its bits
    return result, soft * torch.tensor(scale, dtype=weight.dtype)
