"""What the engine-level kernel tests share: the forwards they compare between kernel sets
(`forwards`, within `TOL`, run through the e2e tests' `Sequences`), and the native kernels'
module mark (`NATIVE`: skipped without a C compiler, each test on a fresh library cache: the
`fresh_native_library` fixture of tests/kernels/conftest.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.model import Mode
from tests.e2e.forward_cases import Sequences

__all__ = ["NATIVE", "TOL", "Sequences", "forwards"]

TOL = 1e-4

NATIVE = [
    pytest.mark.skipif(
        shutil.which("cc") is None, reason="no C compiler on this machine (the twins stay bound)"
    ),
    pytest.mark.usefixtures("fresh_native_library"),
]


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
