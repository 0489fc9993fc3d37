"""Which implementations `kernels.ops` hands out, the lazy triton import, and the CUDA-graph
bucket choice (pure Python)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kernels
from kernels import reference
from kernels.cuda_graphs import GraphBuckets


def test_cpu_gets_the_twins() -> None:
    assert kernels.ops("cpu") is reference


def test_forcing_the_twins_wins_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CANVAS_FORCE_TWINS", "1")
    assert kernels.ops("cuda") is reference


def test_cuda_without_triton_gets_the_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert kernels.ops("cuda") is reference


def test_triton_ops_bind_every_twin_name_to_a_kernel_or_the_twin() -> None:
    pytest.importorskip("triton")
    from kernels import triton_attention, triton_moe, triton_sampler

    module = kernels.triton_ops()
    for name in ("canvas_attention", "write_kv"):
        assert getattr(module, name) is getattr(triton_attention, name)
    for name in ("route_experts", "fused_moe", "grouped_mm"):
        assert getattr(module, name) is getattr(triton_moe, name)
    for name in ("fused_sample", "entropy_accept", "soft_embedding"):
        assert getattr(module, name) is getattr(triton_sampler, name)
    for name in ("rms_norm", "segment_linear", "attention", "PagedRows", "SampleResult"):
        assert getattr(module, name) is getattr(reference, name)


def test_kernels_import_without_triton_and_never_import_it_eagerly() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # as if triton were not installed
        "import kernels\n"
        "assert kernels.ops('cuda') is kernels.reference\n"
        "del sys.modules['triton']; import importlib; importlib.reload(kernels)\n"
        "assert 'triton' not in sys.modules, 'kernels imported triton eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bucket_is_the_smallest_that_fits() -> None:
    buckets = GraphBuckets((1, 2, 4, 8, 16))
    assert [buckets.pick(n) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]


def test_batch_beyond_the_largest_bucket_runs_eagerly() -> None:
    assert GraphBuckets((1, 4)).pick(5) is None


def test_powers_of_two_end_at_the_largest_batch() -> None:
    assert GraphBuckets.powers_of_two(16).sizes == (1, 2, 4, 8, 16)
    assert GraphBuckets.powers_of_two(12).sizes == (1, 2, 4, 8, 12)
    assert GraphBuckets.powers_of_two(1).sizes == (1,)


@pytest.mark.parametrize(
    "sizes,message",
    [
        ((), "at least one"),
        ((0, 2), "positive"),
        ((4, 2), "strictly ascending"),
        ((2, 2), "strictly"),
    ],
)
def test_bad_buckets_are_rejected(sizes: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GraphBuckets(sizes)


def test_a_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="batch must be positive"):
        GraphBuckets((1, 2)).pick(0)
