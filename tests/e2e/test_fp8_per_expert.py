"""FP8 checkpoints whose experts are stored one tensor per expert (llm-compressor's layout for
experts that are Linear modules), written by hand: they load as the fused layout of the same
weights, bit for bit, and every inconsistent one is refused naming the key."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model import CheckpointError, load_model
from engine.model.quant import FP8
from server.cli import main
from tests.e2e.fp8_cases import (
    HAND_LAYOUT,
    IGNORE,
    QUANTIZED,
    first_step_logits,
    fp8_state,
    split_experts,
    write_by_hand,
)

# Layer 0's experts stay unquantized (the ignore list names them): their per-expert tensors
# have no scales, and load fused in the checkpoint's dtype.
LAYOUT = HAND_LAYOUT | {"ignore": [*IGNORE, r"re:.*layers\.0\.experts\..*"]}
QUANTIZED_BUT_LAYER_0_EXPERTS = re.compile(r"(?!.*layers\.0\.experts)" + QUANTIZED.pattern)
L0 = "model.decoder.layers.0.experts"
L1 = "model.decoder.layers.1.experts"


def fused_and_per_expert(source: Path, tmp_path: Path) -> tuple[Path, Path, dict]:
    """The same hand-written FP8 weights in the fused layout and one tensor per expert."""
    fused, per_expert = tmp_path / "fused", tmp_path / "per-expert"
    write_by_hand(source, fused, LAYOUT, QUANTIZED_BUT_LAYER_0_EXPERTS)
    shutil.copytree(fused, per_expert)
    return fused, per_expert, split_experts(per_expert)


def test_a_per_expert_fp8_checkpoint_loads_as_the_fused_layout_bit_for_bit(
    tiny_checkpoint, tmp_path
):
    fused, per_expert, tensors = fused_and_per_expert(tiny_checkpoint("c16"), tmp_path)
    assert tensors[f"{L1}.3.up_proj.weight"].dtype == FP8
    assert tensors[f"{L1}.3.up_proj.weight_scale"].shape == (16, 1)
    assert f"{L0}.0.gate_proj.weight_scale" not in tensors  # ignored: unquantized
    assert not any(key.endswith(("experts.gate_up_proj", "experts.down_proj")) for key in tensors)
    expected = load_model(fused, kernels="twins")
    model = load_model(per_expert, kernels="twins")
    assert model.layers[1].experts.gate_up_proj.dtype == FP8
    assert model.layers[0].experts.gate_up_proj.dtype == expected.embed_tokens.weight.dtype
    state, want = fp8_state(model), fp8_state(expected)
    assert state.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(first_step_logits(model, 0), first_step_logits(expected, 0))


def _fp8_zeros(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape).to(FP8)


# (what is changed in the per-expert tensors, the error it gives)
REFUSED = [
    ({f"{L1}.3.up_proj.weight": None}, rf"missing tensor {L1}\.3\.up_proj\.weight: this"),
    ({f"{L1}.2.down_proj.weight_scale": None}, rf"missing tensor {L1}\.2\.down_proj\.weight_s"),
    ({f"{L1}.gate_up_proj": _fp8_zeros((4, 32, 32))}, rf"{L1}\.gate_up_proj is fused, but"),
    ({f"{L1}.2.gate_proj.weight": _fp8_zeros((15, 32))}, r"2\.gate_proj\.weight has shape \[15"),
    ({f"{L1}.2.gate_proj.weight_scale": torch.ones(16)}, r"shape \[16\], expected \[16, 1\]"),
    ({f"{L1}.4.down_proj.weight": _fp8_zeros((32, 16))}, r"is expert 4, but config.json has"),
    (
        {f"{L1}.1.down_proj.weight": torch.zeros(32, 16), f"{L1}.1.down_proj.weight_scale": None},
        rf"{L1}\.1\.down_proj\.weight has dtype F32 but .* all FP8 or all unquantized",
    ),
    ({f"{L0}.1.down_proj.weight_scale": torch.ones(32, 1)}, r"which is not F8_E4M3"),
    ({f"{L1}.0.gate_proj.input_scale": torch.ones(1)}, r"gate_proj\.input_scale: Canvas reads"),
]


def test_per_expert_checkpoints_the_loader_cannot_stack_are_refused_naming_the_key(
    tiny_checkpoint, tmp_path
):
    _, per_expert, tensors = fused_and_per_expert(tiny_checkpoint("c16"), tmp_path)
    for changes, message in REFUSED:
        changed = {key: t for key, t in tensors.items() if changes.get(key, t) is not None}
        changed |= {key: t for key, t in changes.items() if t is not None}
        save_file(changed, str(per_expert / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_model(per_expert, kernels="twins")
    # an FP8 expert whose module the ignore list names
    save_file(tensors, str(per_expert / "model.safetensors"))
    config = json.loads((per_expert / "config.json").read_text())
    config["quantization_config"]["ignore"].append(r"re:.*layers\.1\.experts\.2\..*")
    (per_expert / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"ignore lists {L1}\.2\.gate_proj$"):
        load_model(per_expert, kernels="twins")


def test_convert_keeps_a_per_expert_source_per_expert_and_loads_as_quantizing_at_load(
    tiny_checkpoint, tmp_path, capsys
):
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoint("c16"), source)
    split_experts(source)  # unquantized, one tensor per expert
    fused = fp8_state(load_model(tiny_checkpoint("c16"), kernels="twins"))
    assert all(torch.equal(t, fused[n]) for n, t in fp8_state(load_model(source)).items())
    out = tmp_path / "fp8"
    assert main(["convert", "--from", str(source), "--to", str(out), "--quantization", "fp8"]) == 0
    capsys.readouterr()
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor(f"{L1}.2.down_proj.weight").dtype == FP8
        assert f"{L1}.2.down_proj.weight_scale" in handle.keys()  # noqa: SIM118 (not a dict)
    converted = fp8_state(load_model(out, kernels="twins"))
    at_load = fp8_state(load_model(tiny_checkpoint("c16"), kernels="twins", quantization="fp8"))
    assert converted.keys() == at_load.keys()
    for name, tensor in at_load.items():
        assert torch.equal(converted[name], tensor), name
