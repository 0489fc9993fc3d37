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
from engine.model import Mode, load_model
from tests.e2e.test_forward_parity import Sequences

pytest.importorskip("triton")

TOL = 1e-4


def forwards(model) -> list[torch.Tensor]:
    """A batched prefill of two prompts (one past the sliding window), a mixed forward (one
    canvas, one commit), then both canvases. Returns each forward's output and the pools."""
    cfg, length = model.cfg, model.config.canvas_length
    gen = torch.Generator().manual_seed(11)
    lens = [5, cfg.sliding_window + 7]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    canvas = torch.randint(0, cfg.vocab_size, (2, length), generator=gen)
    seqs = Sequences(model, 2, max(lens) + 2 * length)
    outs = [seqs.run([seqs.row(i, Mode.ENCODE, 0, lens[i]) for i in range(2)], torch.cat(prompts))]
    mixed = [seqs.row(0, Mode.DECODE, lens[0], length), seqs.row(1, Mode.ENCODE, lens[1], length)]
    outs.append(seqs.run(mixed, canvas.flatten()))
    starts = [lens[0], lens[1] + length]
    dec = [seqs.row(i, Mode.DECODE, starts[i], length) for i in range(2)]
    outs.append(model.logits(seqs.run(dec, canvas.flatten())))
    return outs + seqs.cache.keys + seqs.cache.values


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
