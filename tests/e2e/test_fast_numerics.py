"""Fast numerics (the default) against exact numerics: per-forward values within 1e-4, the
batched sampler against a per-row evaluation of the same algorithm on the same random
numbers, batch-independent random draws, seeded outputs, and canvas convergence."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

import kernels
import kernels.native.attention
import kernels.native.build
import kernels.native.moe
from engine import LLM, SamplingParams
from engine.batched_sampler import (
    NOISE_STREAM,
    SAMPLE_STREAM,
    BatchedSampler,
    counters,
    uniform_tokens,
)
from engine.kv_pages import KVPages, PageGeometry
from engine.model import DiffusionLM, ForwardBatch, Mode, PagedKVCache, Row, load_model
from engine.model.config import LayerType
from engine.params import DecodeMode
from kernels.reference import philox_uniform
from tests.e2e.sampler_cases import make_sampler, resolved

REL_TOL = 1e-4
PAGE = 16


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Scenario:
    """Three forwards over four sequences of one model: a prefill batch, a mixed batch
    (a commit, two canvases, a prefill chunk) and a denoise batch of four canvases."""

    def __init__(self, model: DiffusionLM) -> None:
        cfg = model.cfg
        self.model, self.length = model, model.config.canvas_length
        self.context = 200
        geometry = PageGeometry(PAGE, cfg.sliding_window, self.context, True, True)
        full, ring = geometry.full_pages(self.context), geometry.sliding_ring(self.context)
        pages = KVPages(geometry, full * 4, ring * 4)
        self.tables = [pages.allocate(self.context) for _ in range(4)]
        sizes = {LayerType.FULL: full * 4, LayerType.SLIDING: ring * 4}
        self.cache = PagedKVCache(cfg, sizes, PAGE, torch.float32)

    def row(self, seq: int, mode: Mode, start: int, num: int) -> Row:
        t = self.tables[seq]
        return Row(mode, start, num, {LayerType.FULL: t.full, LayerType.SLIDING: t.sliding()})

    @torch.inference_mode()
    def run(self) -> list[torch.Tensor]:
        cfg, length, model = self.model.cfg, self.length, self.model
        gen = torch.Generator().manual_seed(11)
        lens = [5, 21, 13, 40]
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
        canvas = torch.randint(0, cfg.vocab_size, (4, length), generator=gen)
        soft = torch.randn(4 * length, cfg.hidden_size, generator=gen)

        def forward(rows: list[Row], ids: torch.Tensor, soft_embeds: object) -> torch.Tensor:
            batch = ForwardBatch(rows, cfg.sliding_window, PAGE)
            return model(ids, soft_embeds, batch, self.cache)  # type: ignore[arg-type]

        prefill = [self.row(i, Mode.ENCODE, 0, lens[i] if i < 3 else 24) for i in range(4)]
        ids = torch.cat([prompts[0], prompts[1], prompts[2], prompts[3][:24]])
        out = [forward(prefill, ids, soft[:0])]
        mixed = [
            self.row(0, Mode.DECODE, lens[0], length),
            self.row(1, Mode.DECODE, lens[1], length),
            self.row(2, Mode.ENCODE, lens[2], length),
            self.row(3, Mode.ENCODE, 24, 16),
        ]
        ids = torch.cat([canvas[0], canvas[1], canvas[2], prompts[3][24:]])
        hidden = forward(mixed, ids, soft[: 2 * length])
        out += [hidden, model.logits(hidden[: 2 * length])]
        starts = [lens[0], lens[1], lens[2] + length, lens[3]]
        denoise = [self.row(i, Mode.DECODE, starts[i], length) for i in range(4)]
        hidden = forward(denoise, canvas.view(-1), soft)
        return [*out, hidden, model.logits(hidden)]


@pytest.mark.parametrize("preset", ["c16", "c32-window", "gqa8"])
def test_fast_forward_is_within_1e4_of_exact_for_prefill_mixed_and_denoise_batches(
    preset, tiny_checkpoint
):
    path = tiny_checkpoint(preset)
    exact = Scenario(load_model(path, exact=True)).run()
    fast = Scenario(load_model(path)).run()
    names = ["prefill", "mixed", "mixed logits", "denoise", "logits"]
    for name, f, e in zip(names, fast, exact, strict=True):
        assert rel_err(f, e) <= REL_TOL, name


def test_default_numerics_are_fast_and_exact_is_opt_in(tiny_checkpoint):
    path = tiny_checkpoint("c16")
    fast, exact = load_model(path), load_model(path, exact=True)
    assert not fast.kernels.exact  # one GEMM over all rows (the native tiles, else BLAS)
    native = kernels.native.build.available()
    want = kernels.native.moe.linear if native else kernels.reference.linear
    bound = fast.kernels.linear  # the native one with the model's packed weights
    assert getattr(bound, "func", bound) is want
    assert exact.kernels.exact and exact.kernels.linear is kernels.reference.segment_linear
    attention = exact.layers[0].self_attn.kernels.canvas_attention
    assert attention is kernels.reference.canvas_attention_rowwise
    fast_attention = fast.layers[0].self_attn.kernels.canvas_attention
    native_attention = kernels.native.attention.canvas_attention
    assert fast_attention is (native_attention if native else kernels.reference.canvas_attention)


# -- the batched sampler ---------------------------------------------------------------------


def per_row_step(
    logits: torch.Tensor,
    canvas: torch.Tensor,
    previous_draft: torch.Tensor,
    seed: int,
    canvas_no: int,
    step: int,
    steps_left: int,
    params,  # type: ignore[no-untyped-def]
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One denoising step of one canvas, written out plainly: logits [L, V]."""
    length, vocab = logits.shape
    temperature = (
        params.t_min + (params.t_max - params.t_min) * steps_left / params.max_denoising_steps
    )
    probs = torch.softmax(logits.double() / temperature, -1)
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
    no, st = torch.tensor([canvas_no]), torch.tensor([step])
    u = philox_uniform(torch.tensor([seed]), counters(no, st, SAMPLE_STREAM, length))[0]
    sample = torch.tensor(
        [int((probs[p].cumsum(0) <= u[p] * probs[p].sum()).sum()) for p in range(length)]
    )
    order = torch.argsort(entropy, stable=True)
    accept = torch.zeros(length, dtype=torch.bool)
    total = 0.0
    for p in order.tolist():
        if total <= params.entropy_bound:
            accept[p] = True
        total += float(entropy[p])
    u_noise = philox_uniform(torch.tensor([seed]), counters(no, st + 1, NOISE_STREAM, length))[0]
    new_canvas = torch.where(accept, sample, uniform_tokens(u_noise, vocab))
    draft = logits.argmax(-1)
    stable = bool((draft == previous_draft).all())
    confident = float(entropy.mean()) < params.confidence_threshold
    return new_canvas, draft, (stable and confident) or steps_left - 1 == 0


def bind_all(sampler, params) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Slots 0.. for `params`, in order (the scheduler hands slots out; here the test does)."""
    for slot, p in enumerate(params):
        sampler.bind(slot, p.seed, p)
    return torch.arange(len(params))


def denoise_step(sampler, slots, logits, starting: bool) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """One step as the engine runs it: inputs, the update (pure), then the write."""
    flags = torch.full((len(slots),), starting, dtype=torch.bool)
    _, _, rows = sampler.canvas_inputs(slots, flags)
    new, parts = sampler.denoise(logits, rows)
    sampler.write(new)
    return parts


def test_batched_sampler_equals_a_per_row_evaluation_on_the_same_random_numbers():
    length, vocab, rows = 8, 50, 5
    sampler = make_sampler(rows, length, vocab, hidden=12)
    params = [
        resolved(100 + r, max_denoising_steps=3, confidence_threshold=1.0) for r in range(rows)
    ]
    slots = bind_all(sampler, params)
    canvas, _, _ = sampler.canvas_inputs(slots, torch.ones(rows, dtype=torch.bool))
    canvas = canvas.view(rows, length)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.full((rows, length), -1)
    for step in range(3):
        logits = torch.randn(rows * length, vocab, generator=gen) * 4
        logits[: 2 * length] = logits[:length].repeat(2, 1)  # two rows share their logits...
        finished, steps, draft, failed = denoise_step(sampler, slots, logits, step == 0)
        assert not failed.any()
        for r in range(rows):
            want_canvas, want_draft, want_done = per_row_step(
                logits.view(rows, length, vocab)[r], canvas[r], drafts[r], 100 + r, 0, step,
                3 - step, params[r],
            )  # fmt: skip
            assert torch.equal(sampler.state.canvas[slots[r]], want_canvas), (step, r)
            assert torch.equal(draft.view(rows, length)[r], want_draft)
            assert bool(finished[r]) == want_done and int(steps[r]) == step + 1
        # ...and still draw differently: each request has its own stream.
        assert not torch.equal(sampler.state.canvas[slots[0]], sampler.state.canvas[slots[1]])
        canvas = sampler.state.canvas[slots].clone()
        drafts = draft.view(rows, length).clone()


def test_a_requests_draws_are_the_same_alone_and_in_a_batch_of_16():
    length, vocab = 16, 300
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, length, vocab, generator=gen) * 3
    batch = make_sampler(16, length, vocab, hidden=8)
    params = [resolved(7 + r) for r in range(16)]
    slots = bind_all(batch, params)[torch.randperm(16, generator=gen)]
    start, _, _ = batch.canvas_inputs(slots, torch.ones(16, dtype=torch.bool))
    denoise_step(batch, slots, logits.view(-1, vocab), True)
    for r in range(16):
        alone = make_sampler(1, length, vocab, hidden=8)
        slot = bind_all(alone, [params[int(slots[r])]])
        first, _, _ = alone.canvas_inputs(slot, torch.ones(1, dtype=torch.bool))
        assert torch.equal(first, start.view(16, length)[r])
        denoise_step(alone, slot, logits[r], True)
        assert torch.equal(alone.state.canvas[0], batch.state.canvas[slots[r]])
        assert torch.equal(alone.state.soft[0], batch.state.soft[slots[r]])


def test_greedy_ar_rows_skip_the_draw_and_keep_its_tokens_and_failures():
    """All rows greedy (known on the host): argmax alone, the same tokens and failure flags as
    the general path at temperature 0 — ties to the lowest index, masked (-inf) logits are not
    a failure, NaN is."""
    vocab = 40
    sampler = make_sampler(4, 8, vocab, hidden=8)
    slots = bind_all(
        sampler, [resolved(3 + r, temperature=0.0, mode=DecodeMode.AR) for r in range(4)]
    )
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    logits[0, 5] = logits[0, 9] = 50.0  # a tie
    logits[1, :30] = float("-inf")  # filtered (top-k, a grammar)
    logits[2, 7] = float("nan")
    index = torch.tensor([0, 3, 5, 9])
    general = sampler.sample_ar(logits, slots, index)
    fast = sampler.sample_ar(logits, slots, index, all_greedy=True)
    assert [t.tolist() for t in fast] == [t.tolist() for t in general]
    assert fast[1].tolist() == [0, 0, 1, 0] and int(fast[0][0]) == 5


# -- generation --------------------------------------------------------------------------------


def test_fast_generation_is_seeded(tiny_checkpoint):
    """The same seed in the same batch gives the same output. (Alone and in a batch, only the
    random draws are guaranteed equal: the forward's rounding depends on the batch, and a
    random-weight model's near-flat distributions turn last-bit differences into other tokens.)"""
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    # a few denoising steps per canvas: seeding does not depend on how many
    p = [SamplingParams(max_tokens=40, seed=s, max_denoising_steps=6) for s in (1, 1, 2)]
    a, b, c = llm.generate([[5, 6, 7]] * 3, p)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    assert llm.generate([[5, 6, 7]] * 3, p)[0].output_ids == a.output_ids
    alone = llm.generate([5, 6, 7], p[0])[0].output_ids
    assert llm.generate([5, 6, 7], p[0])[0].output_ids == alone


def test_fast_generation_converges_like_exact_over_20_seeds(tiny_checkpoint):
    path = tiny_checkpoint("c16")
    params = [SamplingParams(max_tokens=48, seed=s, ignore_eos=True) for s in range(20)]
    prompts = [[3 + s % 7, 9, 4 + s % 5] for s in range(20)]
    stats = {}
    for exact in (True, False):
        outs = LLM.from_pretrained(path, exact=exact).generate(prompts, params)
        steps = [n for o in outs for n in o.steps_per_canvas]
        stats[exact] = (sum(steps) / len(steps), sum(o.tokens_per_forward for o in outs) / 20)
    (exact_steps, exact_tpf), (fast_steps, fast_tpf) = stats[True], stats[False]
    assert exact_steps < 40  # the preset converges before the step cap: the check means something
    assert abs(fast_steps - exact_steps) <= 0.25 * exact_steps
    assert abs(fast_tpf - exact_tpf) <= 0.25 * exact_tpf


# -- no Python loops on the fast hot path ------------------------------------------------------
# (The sampler twins `fused_sample` and `soft_embedding` walk the positions in chunks of
# 2**24 / V positions to bound their temporaries: one iteration at the CPU benchmark's shapes.)

HOT_PATH = [
    kernels.reference.linear,
    kernels.reference.canvas_attention,
    kernels.reference.write_kv,
    kernels.reference.entropy_accept,
    BatchedSampler.canvas_inputs,
    BatchedSampler.denoise,
    BatchedSampler.sample_ar,
]


@pytest.mark.parametrize("fn", HOT_PATH, ids=lambda f: f.__qualname__)
def test_no_python_loop_over_rows_or_positions_in_the_fast_hot_path(fn):
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    loops = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp, ast.DictComp, ast.SetComp)
    found = [type(n).__name__ for n in ast.walk(tree) if isinstance(n, loops)]
    assert not found, f"{fn.__qualname__} has a Python loop: {found}"


def test_attention_and_moe_layers_have_no_python_loop():
    from engine.model.diffusion_gemma import Layer
    from engine.model.layers import Attention, GatedMLP

    for fn in (Attention.forward, Layer.forward, Layer.layer_scalar, GatedMLP.forward):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        loops = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp)
        assert not [n for n in ast.walk(tree) if isinstance(n, loops)], fn.__qualname__


# -- the sampler's memory bound ----------------------------------------------------------------

MEMORY_PROBE = """
import resource, sys, torch
from kernels import reference
torch.set_num_threads(1)
positions, vocab, hidden = 2048, 65536, 64
logits = torch.empty(positions, vocab).normal_().mul_(3)  # 512 MiB: the LM head's output
weight = torch.randn(vocab, hidden)
temperature, uniform = torch.full((positions,), 0.7), torch.rand(positions)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = reference.fused_sample(logits, temperature, uniform)
reference.soft_embedding(logits, temperature, result.lse, weight, 8.0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / logits.numel() / 4)
"""


def test_sampler_twins_use_a_bounded_fraction_of_the_logits_memory():
    """At a scaled shape (2,048 positions x 65,536 vocabulary: 512 MiB of logits), sampling and
    the soft embedding add a fraction of the logits' size (~0.5x: a few 64 MiB chunk
    temporaries), not [positions, vocab] temporaries (unchunked, they add ~3x the logits)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, check=True
    )
    growth = float(out.stdout.strip())
    assert growth < 0.75, f"sampling grew the peak RSS by {growth:.2f}x the logits' size"
