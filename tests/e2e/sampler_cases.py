"""A batched sampler over a random embedding and resolved parameters, for the sampler tests."""

from __future__ import annotations

import torch

import kernels
from engine.batched_sampler import BatchedSampler
from engine.params import DecodingDefaults, ResolvedParams, SamplingParams


def make_sampler(num_slots: int, length: int, vocab: int, hidden: int) -> BatchedSampler:
    embedding = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(5))
    ks = kernels.resolve_kernels("cpu", "twins")
    return BatchedSampler(ks, embedding, hidden**0.5, length, num_slots)


def resolved(seed: int, **overrides: object) -> ResolvedParams:
    params = SamplingParams(seed=seed, **overrides)  # type: ignore[arg-type]
    return DecodingDefaults().resolve(params)
