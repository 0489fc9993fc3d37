"""Tiny random-weight DiffusionGemma checkpoints, built with transformers' reference classes.

Used by the tests and by `canvas make-tiny DIR [--preset NAME]`. Each preset is a real
`diffusion_gemma` checkpoint directory (config.json, generation_config.json, model.safetensors,
an offline byte-level tokenizer with a chat template) that both Canvas and
`DiffusionGemmaForBlockDiffusion.from_pretrained` load. Weights are random but shaped so that
the denoiser is confident (peaky logits): canvases converge before the step cap, as a trained
model's do. The vision tower is shrunk to one tiny layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

BASE_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 32,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
    "max_position_embeddings": 8192,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@dataclass(frozen=True, slots=True)
class TinyPreset:
    canvas_length: int
    text: dict[str, Any] = field(default_factory=dict)
    embed_std: float = 0.5
    hub_scale: float = 4.0
    num_hubs: int = 12
    description: str = ""


PRESETS: dict[str, TinyPreset] = {
    "c16": TinyPreset(16, {}, description="canvas 16, GQA 4:2 sliding / 4:1 full (k_eq_v)"),
    "c32-window": TinyPreset(
        32,
        {"sliding_window": 8, "num_key_value_heads": 4, "num_global_key_value_heads": 2},
        description="canvas 32, sliding window 8 (prompts and canvases exceed it), MHA sliding",
    ),
    "c256": TinyPreset(
        256,
        {"num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 64},
        hub_scale=5.0,
        num_hubs=2,
        description="canvas 256 (the real canvas length), GQA 2:1",
    ),
    "gqa8": TinyPreset(
        16,
        {
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "num_global_key_value_heads": 4,
            "sliding_window": 16,
        },
        description="12 layers (2 full), GQA 8:1 sliding / 8:4 full",
    ),
}
DEFAULT_PRESET = "c16"


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level tokenizer that works offline, padded with unused tokens to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(SPECIAL_TOKENS) + alphabet
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>")
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _perturb(model: Any, spec: TinyPreset, seed: int) -> None:
    """Give every norm, scale and scalar a non-trivial value so parity tests see them."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision" in name:
                continue
            if name.endswith("embed_tokens.weight"):
                # A few "hub" tokens with long embeddings make the tied head confident, so
                # canvases converge before the step cap as a trained model's do.
                weight = torch.randn(param.shape, generator=gen) * spec.embed_std
                hubs = torch.randperm(param.shape[0], generator=gen)[: spec.num_hubs]
                weight[hubs] *= spec.hub_scale
                param.copy_(weight)
            elif param.ndim == 1:  # norm weights, router scales, per-expert scales
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(torch.empty(buf.shape).uniform_(0.6, 1.4, generator=gen))


def make_tiny(out_dir: str | Path, preset: str = DEFAULT_PRESET, seed: int = 0) -> Path:
    """Write a tiny checkpoint for `preset` into `out_dir` and return the path."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    text = {**BASE_TEXT_CONFIG, **spec.text}
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=dict(TINY_VISION_CONFIG), canvas_length=spec.canvas_length
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    _perturb(model, spec, seed)
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_new_tokens=256,
        max_denoising_steps=48,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        bos_token_id=text["bos_token_id"],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer(text["vocab_size"]).save_pretrained(out)
    return out
