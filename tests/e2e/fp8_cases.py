"""FP8 checkpoints written by hand in compressed-tensors' layout, and a first denoising step's
logits to compare models by (`test_fp8.py`, `test_fp8_per_expert.py`)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model import Mode
from engine.model.quant import FP8
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


def first_step_logits(
    model: torch.nn.Module, seed: int, prompts: list[list[int]] | None = None
) -> torch.Tensor:
    """The logits [canvas, vocab] of a first denoising step over a random canvas after a
    random 12-token prompt; with `prompts`, [prompt, canvas, vocab], one random canvas after
    each prompt, all in one forward."""
    length, vocab = model.config.canvas_length, model.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    one = prompts is None
    if prompts is None:
        prompts = [torch.randint(0, vocab, (12,), generator=gen).tolist()]
    canvases = torch.randint(0, vocab, (len(prompts), length), generator=gen)
    seqs = Sequences(model, len(prompts), max(map(len, prompts)) + length)
    rows = [seqs.row(i, Mode.ENCODE, 0, len(p)) for i, p in enumerate(prompts)]
    seqs.run(rows, torch.tensor([t for p in prompts for t in p]))
    rows = [seqs.row(i, Mode.DECODE, len(p), length) for i, p in enumerate(prompts)]
    logits = model.logits(seqs.run(rows, canvases.flatten())).float()
    return logits.reshape(length, -1) if one else logits.reshape(len(prompts), length, -1)


def split_experts(path: Path) -> dict[str, torch.Tensor]:
    """Rewrite `path`'s model.safetensors with every fused expert tensor (and its scale) as
    llm-compressor writes experts that are Linear modules: `<p>.experts.<e>.gate_proj.weight`,
    `up_proj`, `down_proj` (and `.weight_scale`), one tensor per expert. Returns the tensors."""
    fused = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)(_scale)?$")
    tensors = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (not a dict)
            tensor, match = handle.get_tensor(key), fused.match(key)
            if match is None:
                tensors[key] = tensor
                continue
            experts, proj, scale = match[1], match[2], match[3] or ""
            names = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            for e, one in enumerate(tensor):
                for name, part in zip(names, one.chunk(len(names)), strict=True):
                    tensors[f"{experts}.{e}.{name}.weight{scale}"] = part.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    return tensors
