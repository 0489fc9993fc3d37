"""The native CPU sampler (`kernels/native/sampler.c`) against its twin, and its fallback."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

import kernels
from kernels import native_cpu, reference

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler on this machine (the twins stay bound)"
)


@pytest.fixture(autouse=True)
def _fresh_library(monkeypatch, tmp_path_factory):
    """Each test builds (or finds) the library under a cache of this session's own."""
    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path_factory.getbasetemp() / "canvas-cache"))
    monkeypatch.delenv("CANVAS_NATIVE", raising=False)
    native_cpu.library.cache_clear()
    yield
    native_cpu.library.cache_clear()


def _inputs(num_positions: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_positions, vocab, generator=g) * 4
    temperature = torch.rand(num_positions, generator=g) * 1.5 + 0.05
    uniform = torch.rand(num_positions, generator=g)
    return logits, temperature, uniform


def _cdf_gap(logits, temperature, uniform, tokens) -> torch.Tensor:
    """How far, in probability, the twin's inverse CDF puts u from the boundary that separates
    the twin's token from `tokens` (0 where they agree)."""
    probs = torch.softmax(logits.double() / temperature.double()[:, None], -1)
    cdf = probs.cumsum(-1)
    target = uniform.double() * cdf[:, -1]
    lo = torch.minimum(tokens, reference.fused_sample(logits, temperature, uniform).sample)
    return (cdf.gather(1, lo[:, None])[:, 0] - target).abs()


@pytest.mark.parametrize("num_positions,vocab", [(1, 1), (5, 7), (33, 513), (64, 8192)])
def test_matches_the_twin(num_positions, vocab):
    logits, temperature, uniform = _inputs(num_positions, vocab, seed=vocab)
    want = reference.fused_sample(logits, temperature, uniform)
    got = native_cpu.fused_sample(logits, temperature, uniform)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-5)
    differ = got.sample != want.sample
    # Both are inverse-CDF draws of the same u; they may part only at a rounding of a boundary.
    assert (_cdf_gap(logits, temperature, uniform, got.sample)[differ] < 1e-5).all()
    assert differ.float().mean() <= 0.02


def test_soft_embedding_matches_the_twin():
    logits, temperature, uniform = _inputs(48, 1000, seed=1)
    weight = torch.randn(1000, 64, generator=torch.Generator().manual_seed(2)) * 0.05
    want, want_soft = reference.sample_and_embed(logits, temperature, uniform, weight, 8.0)
    got, got_soft = native_cpu.sample_and_embed(logits, temperature, uniform, weight, 8.0)
    assert torch.equal(got.argmax, want.argmax)
    torch.testing.assert_close(got_soft, want_soft, rtol=1e-5, atol=1e-6)
    bf16 = weight.to(torch.bfloat16)
    _, soft16 = native_cpu.sample_and_embed(logits, temperature, uniform, bf16, 8.0)
    assert soft16.dtype == torch.bfloat16
    torch.testing.assert_close(soft16.float(), want_soft, rtol=2e-2, atol=2e-2)


def test_rows_do_not_depend_on_their_batch():
    logits, temperature, uniform = _inputs(40, 300, seed=3)
    whole = native_cpu.fused_sample(logits, temperature, uniform)
    for i in (0, 17, 39):
        alone = native_cpu.fused_sample(
            logits[i : i + 1], temperature[i : i + 1], uniform[i : i + 1]
        )
        for field in ("sample", "argmax", "entropy", "lse"):
            assert torch.equal(getattr(alone, field)[0], getattr(whole, field)[i]), (i, field)


def test_non_finite_and_masked_rows():
    vocab = 64
    logits = torch.randn(6, vocab)
    logits[0, 5] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    logits[3, :60] = float("-inf")  # a grammar mask: only the last 4 tokens are allowed
    logits[4] = -1e30
    logits[4, 11] = 0.0  # one token carries all the mass
    logits[5, 20] = 1e4  # peaked by value
    uniform = torch.tensor([0.5, 0.5, 0.5, 0.999, 0.999, 0.0])
    got = native_cpu.fused_sample(logits, torch.ones(6), uniform)
    want = reference.fused_sample(logits, torch.ones(6), uniform)
    assert torch.isnan(got.lse[:3]).all() and torch.isnan(want.lse[:3]).all()
    assert torch.isfinite(got.lse[3:]).all()
    assert int(got.sample[3]) >= 60 and int(got.argmax[3]) >= 60
    assert int(got.sample[4]) == 11 and float(got.entropy[4]) == 0.0
    assert int(got.sample[5]) == 20 == int(got.argmax[5])
    assert torch.equal(got.sample[3:], want.sample[3:])
    torch.testing.assert_close(got.lse[3:], want.lse[3:])


def test_draws_follow_the_distribution():
    """20,000 positions of one 8-token distribution: the counts of the draws fit its
    probabilities (chi-square, 7 degrees of freedom, p > 0.001)."""
    num = 20_000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    logits = row.expand(num, -1).contiguous()
    uniform = torch.rand(num, generator=torch.Generator().manual_seed(4))
    got = native_cpu.fused_sample(logits, torch.full((num,), 0.8), uniform)
    expected = torch.softmax(row.double() / 0.8, -1) * num
    counts = torch.bincount(got.sample, minlength=8).double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, chi2  # the 0.999 quantile of chi-square(7)


def test_fast_cpu_kernels_bind_it_and_others_do_not():
    fast = kernels.resolve_kernels("cpu")
    assert fast.native_sampler and fast.sample_and_embed is native_cpu.sample_and_embed
    assert "native CPU sampler" in fast.describe()
    assert not kernels.resolve_kernels("cpu", "twins").native_sampler
    assert not kernels.resolve_kernels("cpu", exact=True).native_sampler
    assert not fast.with_custom_ops().native_sampler


def test_without_a_compiler_the_twins_stay(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CANVAS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "canvas-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="kernels.native_cpu"):
        ks = kernels.resolve_kernels("cpu")
    assert not ks.native_sampler and ks.sample_and_embed is reference.sample_and_embed
    assert "no C compiler" in caplog.text
    native_cpu.library.cache_clear()
    monkeypatch.delenv("CC")
    monkeypatch.setenv("CANVAS_NATIVE", "0")
    assert not kernels.resolve_kernels("cpu").native_sampler


def test_a_failing_build_says_why(tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        native_cpu.build(broken, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))
