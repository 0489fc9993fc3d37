"""Which kernel set `kernels.resolve_kernels` binds (backend and numerics, chosen once), and the
lazy triton import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference
from kernels.native import attention as native_attention
from kernels.native import build
from kernels.native import moe as native_moe


def test_cpu_gets_the_twins_in_fast_numerics_by_default() -> None:
    ks = kernels.resolve_kernels("cpu")
    # the native kernels where this machine builds them (they fall back to the twins per call),
    # and the set is named for them
    native = build.available()
    assert ks.backend == ("native" if native else "twins") and not ks.exact
    assert ks.linear is (native_moe.linear if native else reference.linear)
    attend = native_attention.canvas_attention if native else reference.canvas_attention
    assert ks.canvas_attention is attend


def test_exact_numerics_bind_the_batch_invariant_twins() -> None:
    ks = kernels.resolve_kernels("cpu", exact=True)
    assert ks.exact and ks.linear is reference.segment_linear
    assert ks.canvas_attention is reference.canvas_attention_rowwise
    assert ks.fused_moe is reference.fused_moe  # takes the per-request segments


@pytest.mark.parametrize("shape", [(1, 32, 256), (1, 480, 4, 64), (7, 3)])
@pytest.mark.parametrize("weighted", [True, False])
def test_fast_rms_norm_gives_the_twins_values(shape: tuple[int, ...], weighted: bool) -> None:
    """Fast numerics' norm: the twin's values to fp32 rounding; other dtypes take the twin."""
    assert kernels.resolve_kernels("cpu", "twins").rms_norm is reference.rms_norm_fused
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen) if weighted else None
    want = reference.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(reference.rms_norm_fused(x, weight, 1e-6), want)
    half = x.to(torch.bfloat16)
    assert torch.equal(
        reference.rms_norm_fused(half, weight, 1e-6), reference.rms_norm(half, weight, 1e-6)
    )


@pytest.mark.parametrize("dim", [37, 256, 576, 2816])
def test_fast_rms_norm_gives_a_row_the_same_bits_alone_and_in_a_big_batch(dim: int) -> None:
    """A few rows take one `F.rms_norm` call, many rows `rms_norm_fused`'s passes
    (`reference.SMALL_NORM`): a row's bits must not depend on which (batch invariance)."""
    gen = torch.Generator().manual_seed(dim)
    rows = reference.SMALL_NORM // dim + 8  # the batch is past the switch, a row is not
    x = torch.randn(1, rows, dim, generator=gen) * torch.rand(1, rows, 1, generator=gen) * 10
    weight = torch.rand(dim, generator=gen) + 0.5
    together = reference.rms_norm_fused(x, weight, 1e-6)
    alone = torch.cat(
        [reference.rms_norm_fused(x[:, i : i + 1], weight, 1e-6) for i in range(rows)], 1
    )
    assert torch.equal(together, alone)
    pair = reference.rms_norm_pair(x, weight, weight.flip(0), 1e-6)
    assert torch.equal(pair[0], together)
    few = reference.rms_norm_pair(x[:, :3], weight, weight.flip(0), 1e-6)
    assert torch.equal(pair[1][:, :3], few[1]) and torch.equal(few[0], together[:, :3])


def test_cuda_without_triton_gets_the_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels.support, "triton_available", lambda: False)
    assert kernels.resolve_kernels("cuda").backend == "twins"
    with pytest.raises(ValueError, match="needs the triton package"):
        kernels.resolve_kernels("cuda", "triton")


def test_unknown_backend_is_refused_by_name() -> None:
    names = "auto, twins, native, triton"
    with pytest.raises(ValueError, match=f"kernel backend must be one of {names}"):
        kernels.resolve_kernels("cpu", "cuda-graphs")


def test_cuda_gets_triton_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    ks = kernels.resolve_kernels("cuda")
    assert ks.backend == "triton"
    assert ks.canvas_attention is kernels.triton_ops().canvas_attention
    assert kernels.resolve_kernels("cuda", "twins").canvas_attention is reference.canvas_attention


@pytest.mark.parametrize("backend", ["twins", "auto"])  # auto: the native CPU kernels too
def test_fast_kernels_ignore_per_request_segments(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 8, generator=gen), torch.randn(6, 8, generator=gen)
    ks = kernels.resolve_kernels("cpu", backend)
    torch.testing.assert_close(ks.linear(x, w, [3, 17]), x @ w.T)
    scale, per_expert = torch.ones(8), torch.ones(4)
    proj = torch.randn(4, 8, generator=gen)
    got = ks.route_experts(x, scale, proj, per_expert, 2, 1e-6, segments=[3, 17])
    want = reference.route_experts(x, scale, proj, per_expert, 2, 1e-6)
    torch.testing.assert_close(got, want)
    # The experts: one grouping over all tokens, outputs scattered into their rows.
    weights, ids = want
    gate_up, down = torch.randn(4, 16, 8, generator=gen), torch.randn(4, 8, 8, generator=gen)
    assert backend == "auto" or ks.fused_moe is reference.fused_moe_scattered
    moe = ks.fused_moe(x, gate_up, down, weights, ids, segments=[3, 17])
    torch.testing.assert_close(moe, reference.fused_moe(x, gate_up, down, weights, ids))


def test_no_kernel_choice_reads_the_environment() -> None:
    """Kernels are chosen once, by arguments: nothing in kernels/ or engine/ reads CANVAS_*."""
    import pathlib

    root = pathlib.Path(kernels.__file__).parent.parent
    for path in [*root.glob("kernels/*.py"), *root.glob("engine/**/*.py")]:
        text = path.read_text()
        assert "CANVAS_FORCE_TWINS" not in text and "CANVAS_TRITON_ON_CPU" not in text, path


def test_triton_ops_bind_every_twin_name_to_a_kernel_or_the_twin() -> None:
    pytest.importorskip("triton")
    from kernels import triton_attention, triton_moe, triton_norm, triton_sampler

    module = kernels.triton_ops()
    for name in ("canvas_attention", "write_kv"):
        assert getattr(module, name) is getattr(triton_attention, name)
    for name in ("route_experts", "fused_moe", "grouped_mm"):
        assert getattr(module, name) is getattr(triton_moe, name)
    for name in ("rms_norm", "qkv_norm_rope", "softcap"):
        assert getattr(module, name) is getattr(triton_norm, name)
    for name in ("fused_sample", "entropy_accept", "soft_embedding", "philox_uniform"):
        assert getattr(module, name) is getattr(triton_sampler, name)
    for name in ("rms_norm_fused", "linear", "attention", "PagedRows", "SampleResult"):
        assert getattr(module, name) is getattr(reference, name)


def test_kernels_import_without_triton_and_never_import_it_eagerly() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # as if triton were not installed
        "import kernels\n"
        "assert kernels.resolve_kernels('cuda').backend == 'twins'\n"
        "del sys.modules['triton']; import importlib; importlib.reload(kernels)\n"
        "assert 'triton' not in sys.modules, 'kernels imported triton eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
