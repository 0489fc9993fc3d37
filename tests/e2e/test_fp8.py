"""FP8 checkpoints on tiny models: written by `canvas convert --quantization fp8` and by hand
in compressed-tensors' layout, quantized at load, refused with --exact, and their quality
against the unquantized model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.build import BuildConfig, CheckpointConfig
from engine.model import CheckpointError, Mode, load_model
from engine.model.quant import FP8
from kernels.reference import dequantize_fp8
from server.cli import main
from tests.e2e.forward_cases import Sequences

# The projections and experts a hand-written checkpoint stores in FP8.
QUANTIZED = re.compile(
    r"model\.decoder\.layers\.\d+\."
    r"(self_attn\.[qkvo]_proj\.weight|mlp\.(gate|up|down)_proj\.weight|experts\.\w+_proj)$"
)
IGNORE = ["lm_head", "re:.*router.*", "re:.*self_conditioning.*", r"re:.*layers\.0\.mlp\..*"]
HAND_LAYOUT = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True, "observer": None},
        }
    },
    "ignore": IGNORE,
    "quantization_status": "compressed",
}  # fmt: skip


def fp8_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters as bytes (FP8 compared bit for bit)."""
    return {
        name: t.view(torch.uint8) if t.dtype == FP8 else t for name, t in model.state_dict().items()
    }


def plan_weights(capsys: pytest.CaptureFixture[str], *args: str) -> int:
    assert main(["plan", *args, "--gpu", "h100", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["weights_bytes"]


def test_convert_then_load_equals_quantizing_at_load(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "fp8"
    assert main(["convert", "--from", str(tiny_checkpoint("c16")), "--to", str(out),
                 "--quantization", "fp8"]) == 0  # fmt: skip
    assert "wrote FP8 checkpoint" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == (
        "float-quantized"
    )
    converted = fp8_state(load_model(out, kernels="twins"))
    at_load = fp8_state(load_model(tiny_checkpoint("c16"), kernels="twins", quantization="fp8"))
    assert converted.keys() == at_load.keys()
    assert converted["layers.1.experts.gate_up_proj"].dtype == torch.uint8  # FP8 bytes
    assert converted["layers.1.experts.gate_up_proj_scale"].shape[-1] == 1
    for name, tensor in at_load.items():
        assert torch.equal(converted[name], tensor), name
    # canvas plan reads an FP8 checkpoint's layout from its config.json
    plans = [
        plan_weights(capsys, "--model", str(out)),
        plan_weights(capsys, "--model", str(tiny_checkpoint("c16")), "--quantization", "fp8"),
        plan_weights(capsys, "--model", str(tiny_checkpoint("c16"))),
    ]
    assert plans[0] == plans[1] < plans[2]
    # --quantization fp8 on an FP8 checkpoint loads it as stored
    again = fp8_state(load_model(out, kernels="twins", quantization="fp8"))
    assert all(torch.equal(again[name], t) for name, t in converted.items())
    assert main(["convert", "--from", str(out), "--to", str(tmp_path / "x"),
                 "--quantization", "fp8"]) == 2  # fmt: skip
    assert "already quantized" in capsys.readouterr().err


def write_by_hand(
    source: Path, out: Path, layout: dict, quantized: re.Pattern = QUANTIZED
) -> dict[str, torch.Tensor]:
    """`source` with the tensors `quantized` matches (but layer 0's MLP) in FP8 with bf16
    scales [out, 1] and `layout` in config.json; returns the dequantized fp32 value of every
    quantized tensor, by key."""
    shutil.copytree(source, out)
    tensors, values = {}, {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (not a dict)
            tensor = handle.get_tensor(key)
            if quantized.match(key) and not re.match(r".*layers\.0\.mlp\.", key):
                w = tensor.float()
                scale = (w.abs().amax(-1, keepdim=True) / 448).to(torch.bfloat16)
                tensor = (w / scale.float()).clamp(-448, 448).to(FP8)
                tensors[key + "_scale"] = scale
                values[key] = tensor.float() * scale.float()
            tensors[key] = tensor
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": layout}))
    return values


def first_step_logits(model: torch.nn.Module, seed: int) -> torch.Tensor:
    """The logits [canvas, vocab] of a first denoising step over a random canvas after a
    12-token prompt."""
    length, vocab = model.config.canvas_length, model.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompt, canvas = (
        torch.randint(0, vocab, (12,), generator=gen),
        torch.randint(0, vocab, (length,), generator=gen),
    )
    seqs = Sequences(model, 1, 64)
    seqs.run([seqs.row(0, Mode.ENCODE, 0, 12)], prompt)
    hidden = seqs.run([seqs.row(0, Mode.DECODE, 12, length)], canvas)
    return model.logits(hidden).float().reshape(length, -1)


def test_a_hand_written_compressed_tensors_checkpoint_loads_and_runs_dequantized(
    tiny_checkpoint, tmp_path
):
    source = tiny_checkpoint("c16")
    values = write_by_hand(source, tmp_path / "fp8", HAND_LAYOUT)
    model = load_model(tmp_path / "fp8", dtype="float32", kernels="twins")
    params = dict(model.named_parameters())
    assert params["layers.1.self_attn.q_proj.weight"].dtype == FP8
    assert params["layers.1.self_attn.q_proj.weight_scale"].dtype == torch.float32
    assert params["layers.0.mlp.up_proj.weight"].dtype == torch.float32  # ignored: as stored
    assert params["layers.1.router.proj.weight"].dtype == torch.float32
    assert params["embed_tokens.weight"].dtype == torch.float32
    # the same model with the dequantized weights, unquantized: the FP8 twins' values exactly
    plain = load_model(source, dtype="float32", kernels="twins")
    plain_params = dict(plain.named_parameters())
    for key, value in values.items():
        plain_params[key.removeprefix("model.decoder.")].data = value
        owner = key.removeprefix("model.decoder.")
        fp8 = dequantize_fp8(params[owner], params[owner + "_scale"], torch.float32)
        assert torch.equal(fp8, value), key
    assert torch.equal(first_step_logits(model, 0), first_step_logits(plain, 0))


def test_fp8_checkpoints_the_loader_cannot_run_are_refused(tiny_checkpoint, tmp_path):
    block = json.loads(json.dumps(HAND_LAYOUT))
    block["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "block", block)
    with pytest.raises(CheckpointError, match="weights.strategy 'block' is not supported"):
        load_model(tmp_path / "block")
    ignored = HAND_LAYOUT | {"ignore": [*IGNORE, "re:.*self_attn.*"]}
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "ignored", ignored)
    with pytest.raises(CheckpointError, match="is F8_E4M3 but quantization_config.ignore lists"):
        load_model(tmp_path / "ignored")
    router = re.compile(f"{QUANTIZED.pattern}|.*router\\.proj\\.weight$")
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "router", HAND_LAYOUT, router)
    with pytest.raises(CheckpointError, match="but Canvas runs layers.0.router.proj.weight unq"):
        load_model(tmp_path / "router")
    no_k = re.compile(r"(?!.*k_proj)" + QUANTIZED.pattern)
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "no-k", HAND_LAYOUT, no_k)
    with pytest.raises(CheckpointError, match="a module's projections all FP8 or none"):
        load_model(tmp_path / "no-k")


def test_an_fp8_checkpoint_with_one_tensor_per_expert_is_refused_naming_the_layout(
    tiny_checkpoint, tmp_path
):
    """llm-compressor's layout for experts that are Linear modules: each expert's gate, up and
    down projections (and their scales) on their own, beside no fused tensor."""
    source = tiny_checkpoint("c16")
    write_by_hand(source, tmp_path / "fused", HAND_LAYOUT)
    per_expert = tmp_path / "per-expert"
    shutil.copytree(tmp_path / "fused", per_expert)
    fused = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_scale)?$")
    tensors = {}
    with safe_open(str(per_expert / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (not a dict)
            tensor, match = handle.get_tensor(key), fused.match(key)
            if match is None:
                tensors[key] = tensor
                continue
            experts, proj, scale = match[1], match[2], match[3] or ""
            for e, one in enumerate(tensor):
                names = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
                for name, part in zip(names, one.chunk(len(names)), strict=True):
                    tensors[f"{experts}.{e}.{name}.weight{scale}"] = part.contiguous()
    save_file(tensors, str(per_expert / "model.safetensors"))
    assert any(".experts.0.gate_proj.weight_scale" in key for key in tensors)
    with pytest.raises(CheckpointError, match=r"one tensor per expert \(model\.decoder\.layers"):
        load_model(per_expert)
    load_model(tmp_path / "fused", kernels="twins")  # the fused layout of the same weights loads


def test_exact_numerics_refuse_fp8(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--exact cannot run --quantization fp8"):
        load_model(tiny_checkpoint("c16"), exact=True, quantization="fp8")
    write_by_hand(tiny_checkpoint("c16"), tmp_path / "fp8", HAND_LAYOUT)
    with pytest.raises(ValueError, match="--exact cannot run an FP8 checkpoint.*--quantization"):
        load_model(tmp_path / "fp8", exact=True)


# The tolerances (docs/gpu.md, "FP8", has the measured figures): random tiny stacks amplify
# weight noise far more than trained ones, so the first step's argmaxes agree well below the
# 99% a trained model is expected to keep; convergence must stay within 10% of the steps.
MIN_FIRST_STEP_AGREEMENT = 0.6
MAX_STEPS_RATIO = 1.10


def test_fp8_quality_against_the_unquantized_model(tiny_checkpoint):
    """About 15 s: steps per canvas need a few canvases run to convergence in both models."""
    path = tiny_checkpoint("c16")
    base = load_model(path, dtype="float32", kernels="twins")
    fp8 = load_model(path, dtype="float32", kernels="twins", quantization="fp8")
    same = [
        (first_step_logits(base, s).argmax(-1) == first_step_logits(fp8, s).argmax(-1)).float()
        for s in range(4)
    ]
    assert torch.cat(same).mean().item() >= MIN_FIRST_STEP_AGREEMENT
    steps = []
    for quantization in ("auto", "fp8"):
        config = CheckpointConfig(path, dtype="float32", kernels="twins", quantization=quantization)
        llm = LLM.from_config(BuildConfig(config))
        prompts = [[5 + i, 6, 7] for i in range(4)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=32, seed=0))
        counts = [n for out in outs for n in out.steps_per_canvas]
        steps.append(sum(counts) / len(counts))
    print(f"first-step agreement {torch.cat(same).mean().item():.3f}, steps per canvas {steps}")
    assert steps[1] <= MAX_STEPS_RATIO * steps[0] and steps[0] <= MAX_STEPS_RATIO * steps[1]
