"""The engine's forward on the Triton kernels (Triton's CPU interpreter, bound with
`kernels="triton"`): paged canvas attention over all rows at once (plus `write_kv` for ENCODE
rows) agrees with the twins, in both numerics.

Compared per forward (hidden states, decoder logits, the KV pools) within 1e-4, not as sampled
tokens: the kernels round differently from the twins (online softmax, other summation orders),
and the tiny random models' near-flat distributions turn such differences into other samples.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.model import load_model
from tests.kernels.native_cases import TOL, forwards

pytest.importorskip("triton")


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
@torch.inference_mode()
def test_engine_forward_on_triton_kernels_matches_the_twins(tiny_checkpoint, exact):
    if not kernels.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/kernels/conftest.py without a GPU)")
    path = tiny_checkpoint("c16")
    want = forwards(load_model(path, exact=exact, kernels="twins"))
    triton_model = load_model(path, exact=exact, kernels="triton")
    assert triton_model.layers[0].self_attn.kernels.backend == "triton"
    got = forwards(triton_model)
    for name, g, w in zip(["prefill", "mixed", "logits"], got, want, strict=False):
        assert torch.isfinite(w).all(), name
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")
    for g, w in zip(got[3:], want[3:], strict=True):  # the KV pools (unused pages are zeros)
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)
