"""Kernel backends are registry entries (`kernels.backends`): the three built in are named
everywhere they are shown, and a toy backend registered here runs a tiny engine end to end
with no edit elsewhere."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine import LLM, SamplingParams
from kernels import backends, reference
from kernels.backends import TwinsBackend
from kernels.native import build


class CountingBackend(TwinsBackend):
    """The twins, with every RMSNorm call counted."""

    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def fast(self, ops):
        def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
            self.calls += 1
            return reference.rms_norm_fused(x, weight, eps)

        return super().fast(ops) | {"rms_norm": rms_norm}


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, backends.Backend]:
    """A copy of the registry for this test (what it registers goes with it)."""
    copy = dict(backends.REGISTRY)
    monkeypatch.setattr(backends, "REGISTRY", copy)
    return copy


def test_users_choose_auto_or_a_registered_name() -> None:
    assert kernels.BACKENDS == ("auto", "twins", "native", "triton")
    assert set(kernels.BACKENDS[1:]) == set(backends.REGISTRY)


@torch.inference_mode()
def test_a_registered_toy_backend_runs_an_engine_end_to_end(tiny_checkpoint, registry) -> None:
    toy = kernels.register(CountingBackend())
    assert registry["counting"] is toy
    path = tiny_checkpoint("c16")
    params = SamplingParams(max_tokens=8, seed=3, max_denoising_steps=4)
    llm = LLM.from_pretrained(path, kernels="counting")
    assert llm.model.kernels.backend == "counting" and llm.engine.limits.kernels == "counting"
    assert llm.model.kernels.describe() == "fast numerics, counting kernels"
    (out,) = llm.generate([5, 6, 7, 8], params)
    assert toy.calls > 0 and len(out.output_ids) > 0
    # the toy's norm is the twins', so the same tokens as the twins give
    (want,) = LLM.from_pretrained(path, kernels="twins").generate([5, 6, 7, 8], params)
    assert out.output_ids == want.output_ids


def test_an_unregistered_name_is_refused_with_the_names_there_are(registry) -> None:
    kernels.register(CountingBackend())
    with pytest.raises(ValueError, match="one of auto, twins, native, triton, counting, got 'x'"):
        kernels.resolve_kernels("cpu", "x")


def test_auto_names_what_it_binds(tiny_checkpoint) -> None:
    """`auto` on the CPU binds the native kernels where they build, and the set, the model and
    the engine's limits (what /health and /v1/models show) say "native"; `twins` stays the
    PyTorch twins without C."""
    native = build.available()
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    assert llm.engine.limits.kernels == ("native" if native else "twins")
    assert llm.model.kernels.describe() == f"fast numerics, {llm.engine.limits.kernels} kernels"
    twins = kernels.resolve_kernels("cpu", "twins")
    assert twins.backend == "twins" and not twins.native
    assert twins.linear is reference.linear and twins.gated_linear is None


def test_the_native_backend_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="'native' runs on the CPU only"):
        kernels.resolve_kernels("cuda", "native")
    with pytest.raises(ValueError, match="'native' carries fast numerics only"):
        kernels.resolve_kernels("cpu", "native", exact=True)


def test_every_backend_takes_the_exact_override(registry) -> None:
    """Exact numerics are the same override on every backend: the reference's per-request
    norms and projections."""
    kernels.register(CountingBackend())
    for name in ("twins", "counting"):
        exact = kernels.resolve_kernels("cpu", name, exact=True)
        assert exact.backend == name and exact.exact
        for kernel, fn in backends.EXACT.items():
            assert getattr(exact, kernel) is fn
        assert exact.canvas_attention is reference.canvas_attention_rowwise
