"""The model package's contracts beyond the parity suite: checkpoint variants the reference
accepts, norm modules that keep the checkpoint's parameter names, and a training head that
equals the inference head."""

from __future__ import annotations

import pytest
import torch

from engine.adapt.forward import TrainKVCache, train_batch, train_logits
from engine.checkpoints.tiny import BASE_TEXT_CONFIG, TINY_VISION_CONFIG, make_tiny
from engine.model import Mode, load_model
from engine.model.config import parse_text_config

# Gemma 4's `attention_k_eq_v` switched off, with global KV heads that differ from the
# sliding layers' (what the flag would change in Gemma 4).
K_NE_V = {"attention_k_eq_v": False, "num_key_value_heads": 2, "num_global_key_value_heads": 1}


def test_attention_k_eq_v_false_parses_to_the_reference_geometry():
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = {**BASE_TEXT_CONFIG, **K_NE_V}
    reference = DiffusionGemmaConfig(
        text_config=text, vision_config=dict(TINY_VISION_CONFIG), canvas_length=16
    )
    ref_text = reference.text_config
    ours = parse_text_config(text)  # no per_layer_config: Canvas derives it as the reference does
    with torch.device("meta"):
        ref_layers = DiffusionGemmaForBlockDiffusion(reference).model.decoder.layers
    for i, spec in enumerate(ours.layers):
        assert spec.head_dim == ref_text.per_layer_config[i].head_dim
        assert spec.num_kv_heads == ref_text.per_layer_config[i].num_key_value_heads
        assert spec.has_v_proj == (ref_layers[i].self_attn.v_proj is not None)
    assert [s.num_kv_heads for s in ours.layers if not s.is_sliding] == [1]


@torch.inference_mode()
def test_attention_k_eq_v_false_checkpoint_matches_the_reference_encoder(tmp_path, reference_model):
    path = make_tiny(tmp_path / "k-ne-v", text_overrides=K_NE_V)
    ours = load_model(path, exact=True)
    ref = reference_model(path)
    ids = torch.randint(0, ours.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    batch = train_batch(Mode.ENCODE, [0], [len(ids)], ours.cfg.sliding_window)
    hidden = ours(ids, [], batch, TrainKVCache())
    ref_hidden = ref.model.encoder(
        input_ids=ids[None], position_ids=torch.arange(len(ids))[None]
    ).last_hidden_state[0]
    assert (hidden - ref_hidden).abs().max() <= 1e-4 * ref_hidden.abs().max()


def test_norm_modules_keep_the_checkpoint_parameter_names(tiny_checkpoint):
    names = set(load_model(tiny_checkpoint("c16")).state_dict())
    assert {
        "norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.k_norm.weight",
        "self_conditioning.pre_norm.weight",
    } <= names
    assert not any("v_norm" in n or "post_norm" in n for n in names)  # weightless norms


@pytest.mark.parametrize("grad", [False, True])
def test_training_head_equals_the_inference_head_bit_for_bit(tiny_checkpoint, grad):
    model = load_model(tiny_checkpoint("c16"))
    hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.logits(hidden)
    with torch.set_grad_enabled(grad):
        model.requires_grad_(grad)
        got = train_logits(model, hidden)
    assert torch.equal(got, expected) and got.requires_grad == grad
