"""Fused sampler, entropy-bound acceptance and soft embedding: Triton kernels vs their twins,
and the twin's Philox stream (the engine's counter-based random numbers) vs Triton's own
`tl.rand`."""

from __future__ import annotations

import pytest
import torch

from kernels import reference, reference_sampler

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kernels import triton_sampler  # noqa: E402  (needs triton)

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _rand_kernel(seed_ptr, offset_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    counters = tl.load(offset_ptr + row) + tl.arange(0, N).to(tl.int64)
    tl.store(out_ptr + row * N + tl.arange(0, N), tl.rand(tl.load(seed_ptr + row), counters))


def test_philox_twin_reproduces_tl_rand_bit_for_bit(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(0, 2**62, (6,), generator=gen)
    seeds[:2] = torch.tensor([0, 2**32 + 7])  # zero key; a key with only the high word set
    offsets = torch.randint(0, 2**40, (6,), generator=gen)
    offsets[:2] = torch.tensor([0, 2**32 - 100])  # a counter that crosses into the high word
    out = torch.empty(6, 256, device=device)
    _rand_kernel[(6,)](seeds.to(device), offsets.to(device), out, N=256)
    want = reference.philox_uniform(seeds[:, None], offsets[:, None] + torch.arange(256))
    assert torch.equal(out.cpu(), want)
    assert float(want.min()) >= 0.0 and float(want.max()) < 1.0


def make_logits(num_pos: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_pos * 1000 + vocab)
    wide = torch.randn(num_pos, vocab + 3, generator=gen) * 3  # rows of a wider tensor
    if num_pos > 2:
        wide[1] = 0.0  # every entry ties: argmax is entry 0
        wide[2, 5] = 200.0  # a confident position: entropy 0
    return {
        "logits": wide[:, :vocab].to(device),
        "temperature": (torch.rand(num_pos, generator=gen) + 0.4).to(device),
        "uniform": torch.rand(num_pos, generator=gen).to(device),
    }


@pytest.mark.parametrize("num_pos,vocab", [(1, 64), (9, 301), (4, 1000)])
def test_fused_sample_matches_twin(num_pos: int, vocab: int, device: torch.device) -> None:
    x = make_logits(num_pos, vocab, device)
    got, want = triton_sampler.fused_sample(**x), reference.fused_sample(**x)
    # Inverse transform sampling: the kernel sums tile by tile, the twin in one cumsum, so a
    # uniform within rounding of a boundary could pick a neighbour; at these sizes none does.
    assert torch.equal(got.sample, want.sample)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-6, atol=1e-6)
    if num_pos > 2:
        assert got.argmax[1] == 0 and got.sample[2] == 5 and abs(float(got.entropy[2])) < 1e-6


def test_inverse_transform_draws_from_the_softmax() -> None:
    """20,000 positions share one distribution and draw with independent uniforms."""
    vocab, draws = 6, 20_000
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 1.5]]).expand(draws, vocab)
    temperature = torch.full((draws,), 0.8)
    uniform = reference.philox_uniform(torch.tensor(1234), torch.arange(draws))
    sample = reference.fused_sample(logits, temperature, uniform).sample
    freq = torch.bincount(sample, minlength=vocab).float() / draws
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 0.8, -1), rtol=0, atol=0.015)


def test_sampler_twin_chunks_give_the_unchunked_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin bounds its temporaries by sampling a few positions at a time."""
    x = make_logits(9, 301, torch.device("cpu"))
    whole = reference.fused_sample(**x)
    monkeypatch.setattr(reference_sampler, "_SAMPLE_CHUNK_ELEMENTS", 301 * 2)  # 2 positions
    parts = reference.fused_sample(**x)
    for name in ("sample", "argmax", "entropy", "lse"):
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name


def test_masked_logits_give_finite_entropy_and_are_never_sampled() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]] * 50)
    uniform = torch.linspace(0, 0.999, 50)
    out = reference.fused_sample(logits, torch.ones(50), uniform)
    assert torch.isfinite(out.entropy).all()
    assert set(out.sample.tolist()) == {0, 2}


@pytest.mark.parametrize("length", [1, 37, 256])
def test_entropy_accept_matches_twin(length: int, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(length)
    entropy = torch.rand(5, length, generator=gen) * 0.02
    entropy[1] = 0.004  # all tied, and the bound cuts the group: ties go by position
    entropy[2] = 0.0
    entropy[3, :2] = torch.tensor([-0.0, -1e-9])[:length]  # rounding can make it negative
    bound = torch.tensor([0.1, 0.05, 0.0, 0.02, 10.0])
    got = triton_sampler.entropy_accept(entropy.to(device), bound.to(device))
    want = reference.entropy_accept(entropy, bound)
    assert got.dtype == torch.bool
    assert torch.equal(got.cpu(), want)
    assert want[4].all() and want[1].tolist() == [i < 13 for i in range(length)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_soft_embedding_matches_twin(dtype: torch.dtype, device: torch.device) -> None:
    x = make_logits(9, 301, device)
    lse = reference.fused_sample(**x).lse
    weight = torch.randn(301, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (x["logits"], x["temperature"], lse, weight.to(device), 6.3125)
    got, want = triton_sampler.soft_embedding(*args), reference.soft_embedding(*args)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_soft_embedding_twin_is_softmax_times_embeddings() -> None:
    x = make_logits(5, 301, torch.device("cpu"))
    weight = torch.randn(301, 24)
    lse = reference.fused_sample(**x).lse
    got = reference.soft_embedding(x["logits"], x["temperature"], lse, weight, 2.0)
    probs = torch.softmax(x["logits"] / x["temperature"][:, None], dim=-1)
    torch.testing.assert_close(got, probs @ weight * 2.0, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@on_gpu
def test_sampler_real_vocab_on_gpu() -> None:
    x = make_logits(256, 262_144, torch.device("cuda"))
    got, want = triton_sampler.fused_sample(**x), reference.fused_sample(**x)
    # The GPU's fast log/exp differ from torch's in the last bit: near-ties may flip.
    assert (got.sample == want.sample).float().mean() > 0.99
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-4)
    weight = torch.randn(262_144, 2816, device="cuda", dtype=torch.bfloat16)
    args = (x["logits"], x["temperature"], want.lse, weight, 53.0)
    got_soft = triton_sampler.soft_embedding(*args)
    torch.testing.assert_close(got_soft, reference.soft_embedding(*args), rtol=2e-2, atol=2e-2)


def test_sample_and_embed_twin_equals_its_two_kernels_and_the_triton_version(
    device: torch.device,
) -> None:
    x = make_logits(9, 301, device)
    weight = torch.randn(301, 40, generator=torch.Generator().manual_seed(2)).to(device)
    result, soft = reference.sample_and_embed(*x.values(), weight, 6.5)
    alone = reference.fused_sample(**x)
    for name in ("sample", "argmax", "entropy", "lse"):
        assert torch.equal(getattr(result, name), getattr(alone, name)), name
    want = reference.soft_embedding(x["logits"], x["temperature"], alone.lse, weight, 6.5)
    torch.testing.assert_close(soft, want, rtol=1e-5, atol=1e-5)
    got, got_soft = triton_sampler.sample_and_embed(*x.values(), weight, 6.5)
    assert torch.equal(got.sample, result.sample)
    torch.testing.assert_close(got_soft, soft, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "seed_shape,counter_shape",
    [((5, 1), (5, 37)), ((7,), (7,)), ((), (300,)), ((), ()), ((2, 1, 1), (2, 3, 4))],
)
def test_philox_kernel_is_the_twins_stream_bit_for_bit(
    seed_shape: tuple[int, ...], counter_shape: tuple[int, ...], device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(len(seed_shape) * 10 + len(counter_shape))
    seeds = torch.randint(0, 2**62, seed_shape, generator=gen)
    counters = torch.randint(0, 2**61, counter_shape, generator=gen)
    got = triton_sampler.philox_uniform(seeds.to(device), counters.to(device))
    want = reference.philox_uniform(seeds, counters)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got.cpu(), want)


def test_sample_and_embed_chunks_give_the_unchunked_result(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    x = make_logits(7, 301, device)
    weight = torch.randn(301, 24, generator=torch.Generator().manual_seed(3)).to(device)
    whole, whole_soft = triton_sampler.sample_and_embed(*x.values(), weight, 2.0)
    alone = triton_sampler.soft_embedding(x["logits"], x["temperature"], whole.lse, weight, 2.0)
    monkeypatch.setattr(triton_sampler, "PROBS_CHUNK_BYTES", 3 * 301 * 4)  # 3 positions
    parts, parts_soft = triton_sampler.sample_and_embed(*x.values(), weight, 2.0)
    for name in ("sample", "argmax", "entropy", "lse"):
        assert torch.equal(getattr(parts, name), getattr(whole, name)), name
    # The GEMM's rounding may depend on its row count (fast numerics: reassociation only).
    torch.testing.assert_close(parts_soft, whole_soft, rtol=1e-6, atol=1e-6)
    chunked = triton_sampler.soft_embedding(x["logits"], x["temperature"], whole.lse, weight, 2.0)
    torch.testing.assert_close(chunked, alone, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(alone, whole_soft, rtol=1e-5, atol=1e-5)
