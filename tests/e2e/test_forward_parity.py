"""Per-forward parity with transformers' DiffusionGemmaForBlockDiffusion (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine.model import Mode, load_model
from tests.conftest import ALL_PRESETS
from tests.e2e.forward_cases import Sequences

REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("preset", ALL_PRESETS)
@torch.inference_mode()
def test_encoder_kv_and_decoder_logits_match_reference(preset, tiny_checkpoint, reference_model):
    path = tiny_checkpoint(preset)
    ref = reference_model(path)
    ours = load_model(path, exact=True)
    cfg, length = ours.cfg, ours.config.canvas_length
    window = cfg.sliding_window
    num_prompt = 2 * window + 3  # longer than the sliding window
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, cfg.vocab_size, (num_prompt,), generator=gen)
    canvas = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
    committed = torch.randint(0, cfg.vocab_size, (length,), generator=gen)

    ref_cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    seqs = Sequences(ours, 1, num_prompt + 2 * length)

    # Prefill (encoder over the prompt): hidden states and every layer's KV.
    ref_h = ref.model.encoder(
        input_ids=prompt[None], cache=ref_cache, position_ids=torch.arange(num_prompt)[None]
    ).last_hidden_state[0]
    h = seqs.run([seqs.row(0, Mode.ENCODE, 0, num_prompt)], prompt)
    assert rel_err(h, ref_h) <= REL_TOL
    for i, layer in enumerate(ref_cache.layers):
        kept = layer.keys.shape[2]  # sliding layers keep only their window
        sliding = cfg.layers[i].is_sliding
        assert kept == (min(num_prompt, window - 1) if sliding else num_prompt)
        k, v = seqs.cached(i, 0, num_prompt - kept, num_prompt)
        assert rel_err(k, layer.keys[0]) <= REL_TOL
        assert rel_err(v, layer.values[0]) <= REL_TOL

    # Commit pass (encoder over a finished canvas after the prompt).
    positions = torch.arange(num_prompt, num_prompt + length)[None]
    ref_h = ref.model.encoder(
        input_ids=committed[None], cache=ref_cache, position_ids=positions
    ).last_hidden_state[0]
    h = seqs.run([seqs.row(0, Mode.ENCODE, num_prompt, length)], committed)
    assert rel_err(h, ref_h) <= REL_TOL
    prefix = num_prompt + length

    # Decoder: first step (no self-conditioning) and a later step (self-conditioned).
    dec_positions = torch.arange(prefix, prefix + length)[None]
    dec = [seqs.row(0, Mode.DECODE, prefix, length)]
    ref_logits = ref(
        decoder_input_ids=canvas[None], cache=ref_cache, decoder_position_ids=dec_positions
    ).logits[0]
    logits = ours.logits(seqs.run(dec, canvas))
    assert rel_err(logits, ref_logits) <= REL_TOL

    scaled = ref_logits / 0.6
    ref_logits2 = ref(
        decoder_input_ids=canvas[None],
        cache=ref_cache,
        self_conditioning_logits=scaled[None],
        decoder_position_ids=dec_positions,
    ).logits[0]
    logits2 = ours.logits(seqs.run(dec, canvas, [ours.soft_embed(scaled)]))
    assert rel_err(logits2, ref_logits2) <= REL_TOL
    assert rel_err(logits2, logits) > REL_TOL  # self-conditioning changes the output


@torch.inference_mode()
def test_mixed_batch_rows_equal_single_row_passes_bit_for_bit(tiny_checkpoint):
    """One forward with a prefill row, a commit row and two canvases of requests with different
    prefix lengths gives every row exactly what it gets alone."""
    ours = load_model(tiny_checkpoint("c32-window"), exact=True)
    cfg, length = ours.cfg, ours.config.canvas_length
    gen = torch.Generator().manual_seed(3)
    lens = [5, 21, 13, 40]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lens]
    canvas = torch.randint(0, cfg.vocab_size, (4, length), generator=gen)
    soft = torch.randn(length, cfg.hidden_size, generator=gen)
    context = max(lens) + 2 * length

    def prepare(seqs: Sequences, idx: list[int], slot: list[int]) -> None:
        for i, s in zip(idx, slot, strict=True):
            seqs.run([seqs.row(s, Mode.ENCODE, 0, lens[i])], prompts[i])

    # Alone: each request in its own cache.
    alone = []
    for i in range(4):
        seqs = Sequences(ours, 1, context)
        prepare(seqs, [i], [0])
        if i < 2:  # requests 0 and 1 denoise (1 with self-conditioning)
            out = ours.logits(
                seqs.run(
                    [seqs.row(0, Mode.DECODE, lens[i], length)], canvas[i], [soft if i else None]
                )
            )
        elif i == 2:  # request 2 commits a canvas
            out = seqs.run([seqs.row(0, Mode.ENCODE, lens[i], length)], canvas[i])
        else:  # request 3 is mid-prefill: its second chunk
            seqs2 = Sequences(ours, 1, context)
            seqs2.run([seqs2.row(0, Mode.ENCODE, 0, 24)], prompts[3][:24])
            out = seqs2.run([seqs2.row(0, Mode.ENCODE, 24, 16)], prompts[3][24:])
        alone.append(out)

    # Together: one forward pass with all four rows.
    seqs = Sequences(ours, 4, context)
    prepare(seqs, [0, 1, 2], [0, 1, 2])
    seqs.run([seqs.row(3, Mode.ENCODE, 0, 24)], prompts[3][:24])
    rows = [
        seqs.row(2, Mode.ENCODE, lens[2], length),
        seqs.row(0, Mode.DECODE, lens[0], length),
        seqs.row(3, Mode.ENCODE, 24, 16),
        seqs.row(1, Mode.DECODE, lens[1], length),
    ]
    ids = torch.cat([canvas[2], canvas[0], prompts[3][24:], canvas[1]])
    hidden = seqs.run(rows, ids, [None, soft])
    o = 0
    together = []
    for row in rows:
        together.append(hidden[o : o + row.num_tokens])
        o += row.num_tokens
    # Batch invariance: bit for bit what each row gets alone.
    assert torch.equal(together[0], alone[2])
    assert torch.equal(ours.logits(together[1]), alone[0])
    assert torch.equal(together[2], alone[3])
    assert torch.equal(ours.logits(together[3]), alone[1])
