"""`canvas convert --quantization fp8`: a checkpoint's FP8 copy in the layout `load_model` reads
(`engine.model.quant`: compressed-tensors' per-channel FP8, `<name>` F8_E4M3 beside
`<name>_scale` fp32 [..., out, 1]).

Each weight file is rewritten under its own name, one tensor at a time, so memory holds at most
one file's tensors: the projections and experts quantized exactly as `--quantization fp8`
quantizes them at load (loading either gives the same FP8 weights and scales bit for bit), every
other tensor copied as stored. The experts keep the source's layout: fused (`experts.
gate_up_proj` and `experts.down_proj`, as Canvas and transformers write them) or one tensor per
expert (`engine.model.per_expert`), each quantized per output channel, which gives the same
bits. The other files (tokenizer, generation config, adapter) are copied; config.json gains
the `quantization_config`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model.config import CheckpointError
from engine.model.loader import BACKBONES, checkpoint_names, load_model_config, weight_files
from engine.model.per_expert import expert_weight
from engine.model.quant import SCALE_SUFFIX, Fp8Layout, fp8_candidates, quantize_fp8, read_layout

INDEX = "model.safetensors.index.json"


def write_fp8_checkpoint(source: str | Path, out: str | Path) -> Path:
    """Write `source`'s FP8 copy to `out` (created; it must not hold a checkpoint already).
    CheckpointError when `source` is not a block-diffusion checkpoint Canvas loads, is already
    quantized, or `out` holds one."""
    source, out = Path(source), Path(out)
    config = load_model_config(source)  # CheckpointError naming what is wrong
    if read_layout(source) is not None:
        raise CheckpointError(f"{source}: already quantized (config.json quantization_config)")
    if (out / "config.json").exists():
        raise CheckpointError(f"--to {out}: already holds a checkpoint")
    files = weight_files(source)
    with torch.device("meta"):
        model = BACKBONES[config.model_type](config)
    names = [name for group in fp8_candidates(model).values() for name in group]
    shutil.copytree(
        source, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX), dirs_exist_ok=True
    )
    added: dict[str, str] = {}  # scale key -> its file
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            quantize = {_key(name, keys) for name in names}
            quantize |= {key for key in keys if expert_weight(key)}  # experts stored one by one
            tensors = {}
            for key in sorted(keys):
                tensor = handle.get_tensor(key)
                if key in quantize:
                    tensor, tensors[key + SCALE_SUFFIX] = quantize_fp8(tensor)
                    added[key + SCALE_SUFFIX] = path.name
                tensors[key] = tensor.contiguous()
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
    if (source / INDEX).is_file():
        index = json.loads((source / INDEX).read_text())
        index["weight_map"] |= added
        index.pop("metadata", None)  # its total_size counted the unquantized bytes
        (out / INDEX).write_text(json.dumps(index, indent=2))
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = Fp8Layout().as_config()
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def _key(name: str, keys: set[str]) -> str | None:
    """The key of `keys` that holds Canvas parameter `name`, if this file holds it."""
    return next((key for key in checkpoint_names(name) if key in keys), None)
