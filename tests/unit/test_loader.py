"""The checkpoint loader: what loads, and failures that name the offending tensor or key."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model import CheckpointError, load_model

KEY = "model.decoder.layers.0.mlp.gate_proj.weight"


@pytest.fixture
def checkpoint_copy(tiny_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("c16"), dst)
    return dst


def rewrite(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(checkpoint_copy):
    rewrite(checkpoint_copy, lambda t: t.pop(KEY))
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.decoder\.layers\.0\.mlp\.gate_proj\.weight"
    ):
        load_model(checkpoint_copy)


def test_wrong_shape_names_tensor_and_expected_shape(checkpoint_copy):
    rewrite(checkpoint_copy, lambda t: t.__setitem__(KEY, torch.zeros(3, 5)))
    with pytest.raises(
        CheckpointError, match=r"gate_proj\.weight has shape \[3, 5\], expected \[64, 32\]"
    ):
        load_model(checkpoint_copy)


def test_wrong_dtype_names_tensor_and_expected_dtype(checkpoint_copy):
    rewrite(checkpoint_copy, lambda t: t.__setitem__(KEY, t[KEY].to(torch.float16)))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has dtype F16, expected float32"):
        load_model(checkpoint_copy)


def test_integer_tensor_is_rejected(checkpoint_copy):
    rewrite(checkpoint_copy, lambda t: t.__setitem__(KEY, t[KEY].to(torch.int32)))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has dtype I32"):
        load_model(checkpoint_copy)


def test_unknown_model_type_is_named(checkpoint_copy):
    edit_config(checkpoint_copy, lambda c: c.__setitem__("model_type", "llama"))
    with pytest.raises(CheckpointError, match=r"model_type='llama' is not supported"):
        load_model(checkpoint_copy)


def test_missing_config_key_is_named(checkpoint_copy):
    edit_config(checkpoint_copy, lambda c: c["text_config"].pop("num_experts"))
    with pytest.raises(CheckpointError, match=r"missing required key 'num_experts'"):
        load_model(checkpoint_copy)


def test_missing_weights_and_config_are_reported(tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "diffusion_gemma", "text_config": {}})
    )
    with pytest.raises(CheckpointError, match="missing required key"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint_copy, tiny_checkpoint, caplog):
    from transformers import DiffusionGemmaForBlockDiffusion

    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(tiny_checkpoint("c16"))
    sharded = checkpoint_copy.parent / "sharded"
    ref.save_pretrained(sharded, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    with caplog.at_level(logging.INFO, logger="engine.model.loader"):
        a = load_model(sharded)
    b = load_model(tiny_checkpoint("c16"))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert a.vision is not None  # the vision tower is loaded, from the shards too
    assert not [r for r in caplog.records if "unrecognised" in r.getMessage()]


def test_encoder_named_weights_are_accepted(checkpoint_copy):
    """Tied weights may be stored under the encoder's names instead of the decoder's."""
    original = load_model(checkpoint_copy)

    def rename(t: dict) -> None:
        for key in [
            k for k in t if k.startswith("model.decoder.layers.") and not k.endswith("layer_scalar")
        ]:
            t[key.replace("model.decoder.", "model.encoder.language_model.")] = t.pop(key)

    rewrite(checkpoint_copy, rename)
    renamed = load_model(checkpoint_copy)
    for (name, x), (_, y) in zip(
        original.state_dict().items(), renamed.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name


def test_bfloat16_load_casts_every_weight(checkpoint_copy):
    model = load_model(checkpoint_copy, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype='int8' is not supported"):
        load_model(checkpoint_copy, dtype="int8")
