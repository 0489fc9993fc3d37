"""Per-forward parity with transformers' DiffusionGemmaForBlockDiffusion (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.model import DenseKVCache, ForwardBatch, Mode, load_model
from tests.conftest import ALL_PRESETS

REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def batch(mode: Mode, starts: list[int], nums: list[int], window: int) -> ForwardBatch:
    return ForwardBatch(
        mode=mode,
        slots=torch.arange(len(starts)),
        start_pos=torch.tensor(starts),
        num_tokens=torch.tensor(nums),
        sliding_window=window,
    )


@pytest.mark.parametrize("preset", ALL_PRESETS)
@torch.inference_mode()
def test_encoder_kv_and_decoder_logits_match_reference(preset, tiny_checkpoint, reference_model):
    path = tiny_checkpoint(preset)
    ref = reference_model(path)
    ours = load_model(path)
    cfg, length = ours.cfg, ours.config.canvas_length
    window = cfg.sliding_window
    num_prompt = 2 * window + 3  # longer than the sliding window
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (1, num_prompt), generator=gen)
    canvas = torch.randint(0, cfg.vocab_size, (1, length), generator=gen)
    committed = torch.randint(0, cfg.vocab_size, (1, length), generator=gen)

    ref_cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    cache = DenseKVCache(cfg, 1, num_prompt + 2 * length, torch.float32)

    # Prefill (encoder over the prompt): hidden states and every layer's KV.
    ref_h = ref.model.encoder(
        input_ids=prompt, cache=ref_cache, position_ids=torch.arange(num_prompt)[None]
    ).last_hidden_state
    h = ours.encode(prompt, batch(Mode.ENCODE, [0], [num_prompt], window), cache)
    assert rel_err(h, ref_h) <= REL_TOL
    for i, layer in enumerate(ref_cache.layers):
        kept = layer.keys.shape[2]  # sliding layers keep only their window
        assert kept == (min(num_prompt, window - 1) if cfg.layers[i].is_sliding else num_prompt)
        assert (
            rel_err(cache.keys[i][0, :, num_prompt - kept : num_prompt], layer.keys[0]) <= REL_TOL
        )
        assert (
            rel_err(cache.values[i][0, :, num_prompt - kept : num_prompt], layer.values[0])
            <= REL_TOL
        )

    # Commit pass (encoder over a finished canvas after the prompt).
    positions = torch.arange(num_prompt, num_prompt + length)[None]
    ref_h = ref.model.encoder(
        input_ids=committed, cache=ref_cache, position_ids=positions
    ).last_hidden_state
    h = ours.encode(committed, batch(Mode.ENCODE, [num_prompt], [length], window), cache)
    assert rel_err(h, ref_h) <= REL_TOL
    prefix = num_prompt + length

    # Decoder: first step (no self-conditioning) and a later step (self-conditioned).
    dec_positions = torch.arange(prefix, prefix + length)[None]
    dec = batch(Mode.DECODE, [prefix], [length], window)
    ref_logits = ref(
        decoder_input_ids=canvas, cache=ref_cache, decoder_position_ids=dec_positions
    ).logits
    logits = ours.logits(ours.decode(canvas, None, dec, cache))
    assert rel_err(logits, ref_logits) <= REL_TOL

    scaled = ref_logits / 0.6
    ref_logits2 = ref(
        decoder_input_ids=canvas,
        cache=ref_cache,
        self_conditioning_logits=scaled,
        decoder_position_ids=dec_positions,
    ).logits
    logits2 = ours.logits(ours.decode(canvas, ours.soft_embed(scaled), dec, cache))
    assert rel_err(logits2, ref_logits2) <= REL_TOL
    assert rel_err(logits2, logits) > REL_TOL  # self-conditioning changes the output


@torch.inference_mode()
def test_rows_with_different_prefix_lengths_match_single_row_passes(tiny_checkpoint):
    """A mixed batch (two requests, different prompt lengths) gives each row what it gets alone."""
    ours = load_model(tiny_checkpoint("c32-window"))
    cfg, length = ours.cfg, ours.config.canvas_length
    window = cfg.sliding_window
    gen = torch.Generator().manual_seed(3)
    lens = [5, 21]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    canvases = torch.randint(0, cfg.vocab_size, (2, length), generator=gen)

    padded = torch.zeros(2, max(lens), dtype=torch.long)
    for row, p in enumerate(prompts):
        padded[row, : len(p)] = p
    cache = DenseKVCache(cfg, 2, 64, torch.float32)
    h = ours.encode(padded, batch(Mode.ENCODE, [0, 0], lens, window), cache)
    logits = ours.logits(
        ours.decode(canvases, None, batch(Mode.DECODE, lens, [length] * 2, window), cache)
    )

    for row, p in enumerate(prompts):
        single = DenseKVCache(cfg, 1, 64, torch.float32)
        h1 = ours.encode(p[None], batch(Mode.ENCODE, [0], [len(p)], window), single)
        assert rel_err(h[row, : len(p)], h1[0]) <= 1e-5
        dec = batch(Mode.DECODE, [len(p)], [length], window)
        logits1 = ours.logits(ours.decode(canvases[row : row + 1], None, dec, single))
        assert rel_err(logits[row], logits1[0]) <= 1e-5
