"""Tiny random-weight DiffusionGemma checkpoints, built with transformers' reference classes.

Used by the tests, the benchmarks, `canvas make-tiny DIR [--preset NAME]` and `canvas serve
--placeholder-model`. Each preset is a
real `diffusion_gemma` checkpoint directory (config.json, generation_config.json,
model.safetensors, an offline byte-level tokenizer with a chat template) that both Canvas and
`DiffusionGemmaForBlockDiffusion.from_pretrained` load. Weights are random but shaped so that
the denoiser is confident (peaky logits): canvases converge before the step cap, as a trained
model's do. The vision tower is shrunk to one tiny layer; with `vision=True` it is a working
one (two layers, 4x4-pixel patches, random weights), with image tokens in the tokenizer and an
image processor config, for image input tests.

`bench-small` is the CPU benchmark checkpoint: the real model's layer pattern, attention
geometry and MoE structure scaled down to a few tens of millions of parameters.
`REAL_26B_A4B_TEXT_CONFIG` describes the real 26B-A4B text stack (config only: 25B parameters
are never instantiated on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Gemma 4's markup: turns, the thinking switch and channel, tool declarations, calls and
# responses, and its string delimiter. The two turn tokens keep ids 4 and 5; the rest follow the
# byte alphabet (in slots that were unused), so every other token id is unchanged.
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>")
MARKUP_TOKENS = (
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)
# A compact chat template in Gemma 4's format (what `server.parsers` reads back): a system turn
# holding the thinking switch and the tool declarations, assistant tool calls and the tool
# responses inside the model's turn, and the generation prompt left out when the model goes on
# after a tool response. Values are written as Gemma 4 writes them (strings between <|"|>).
# A conversation without tools or thinking renders to the same ids as Gemma's turn format did.
CHAT_TEMPLATE = """\
{%- macro fmt(v) -%}
{%- if v is string -%}<|"|>{{ v }}<|"|>
{%- elif v is boolean -%}{{ 'true' if v else 'false' }}
{%- elif v is none -%}null
{%- elif v is mapping -%}{{ '{' }}{% for k, x in v | dictsort %}{{ k }}:{{ fmt(x) }}\
{{ ',' if not loop.last }}{% endfor %}{{ '}' }}
{%- elif v is sequence -%}[{% for x in v %}{{ fmt(x) }}{{ ',' if not loop.last }}{% endfor %}]
{%- else -%}{{ v }}{%- endif -%}
{%- endmacro -%}
{{ bos_token }}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set ns = namespace(open=false, rest=messages) -%}
{%- if thinking or tools or messages[0]['role'] == 'system' -%}
<|turn>system\n{{ '<|think|>\n' if thinking }}
{%- if messages[0]['role'] == 'system' -%}
{{ messages[0]['content'] }}{% set ns.rest = messages[1:] %}
{%- endif -%}
{%- for tool in tools or [] -%}
<|tool>declaration:{{ tool['function']['name'] }}\
{description:{{ fmt(tool['function']['description'] or '') }}\
,parameters:{{ fmt(tool['function']['parameters'] or {}) }}{{ '}' }}<tool|>
{%- endfor -%}
{{ '<turn|>\n' }}
{%- endif -%}
{%- for m in ns.rest -%}
{%- if m['role'] == 'tool' -%}
<|tool_response>response:{{ m['name'] }}{value:{{ fmt(m['content']) }}}<tool_response|>
{%- else -%}
{%- if not (ns.open and m['role'] == 'assistant') -%}
{{ '<turn|>\n' if ns.open }}<|turn>\
{{ 'model' if m['role'] == 'assistant' else m['role'] }}{{ '\n' }}
{%- endif -%}
{%- if m.get('reasoning_content') and m.get('tool_calls') -%}
<|channel>thought\n{{ m['reasoning_content'] }}<channel|>
{%- endif -%}
{%- if m['content'] is string or not m['content'] -%}{{ m['content'] or '' }}
{%- else -%}{%- for p in m['content'] -%}
{{ p['text'] if p['type'] == 'text' else '<|image|>' }}
{%- endfor -%}{%- endif -%}
{%- for call in m.get('tool_calls') or [] -%}
<|tool_call>call:{{ call['function']['name'] }}{{ fmt(call['function']['arguments']) }}<tool_call|>
{%- endfor -%}
{%- set ns.open = (m.get('tool_calls') or []) | length > 0 -%}
{{ '<turn|>\n' if not ns.open }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and not ns.open -%}<|turn>model{{ '\n' }}{%- endif -%}"""

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

# `make_tiny(vision=True)`: a tower that runs in milliseconds (4x4-pixel patches, so an image
# becomes at most 70 soft tokens of 3x3 patches: about 100x100 pixels), GQA 2:1, two layers;
# image markup in the tokenizer's unused slots (Gemma 4's spellings).
VISION_TOKENS = ("<|image>", "<|image|>", "<image|>")  # begin-of-image, image, end-of-image
VISION_TOKEN_NAMES = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>"}
TINY_VISION_TEST_CONFIG: dict[str, Any] = {
    **TINY_VISION_CONFIG,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "patch_size": 4,
    "position_embedding_size": 256,
}
TINY_MAX_SOFT_TOKENS = 70  # the smallest budget transformers' Gemma 4 processor allows


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
    # The 26B-A4B text stack scaled to a small CPU: 5 sliding + 1 full layer, GQA 2:1 on
    # sliding layers and 8:1 with a double head_dim and no v_proj on the full layer, a dense
    # GeGLU of 0.75 x hidden plus 16 experts (top-2) of 0.25 x hidden, the window 4x the canvas.
    "bench-small": TinyPreset(
        64,
        {
            "vocab_size": 8192,
            "hidden_size": 512,
            "intermediate_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "global_head_dim": 128,
            "num_global_key_value_heads": 1,
            "sliding_window": 256,
            "num_experts": 16,
            "top_k_experts": 2,
            "moe_intermediate_size": 128,
        },
        description="CPU benchmark: canvas 64, hidden 512, 6 layers (5 sliding + 1 full), "
        "16 experts top-2, vocab 8192",
    ),
    # The second CPU benchmark checkpoint: small matrices, so a step's fixed per-layer costs
    # (gathers, index building, MoE routing, norms) weigh against its GEMMs, as on a GPU.
    "bench-tiny": TinyPreset(
        32,
        {
            "vocab_size": 512,
            "hidden_size": 256,
            "intermediate_size": 192,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "global_head_dim": 128,
            "num_global_key_value_heads": 1,
            "sliding_window": 128,
            "num_experts": 16,
            "top_k_experts": 4,
            "moe_intermediate_size": 64,
        },
        description="CPU benchmark, per-step costs: canvas 32, hidden 256, 6 layers "
        "(5 sliding + 1 full), 16 experts top-4, vocab 512",
    ),
}
DEFAULT_PRESET = "c16"

# The text stack of google/diffusiongemma-26B-A4B-it (DESIGN.md section 1), for GPU benchmarks
# with random weights. Config only: its 25.2B parameters are never instantiated on a CPU.
REAL_26B_A4B_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "max_position_embeddings": 262_144,
    "pad_token_id": 0,
    "eos_token_id": [1, 106],
    "bos_token_id": 2,
    "use_bidirectional_attention": "vision",  # image tokens attend to their whole image
}
REAL_26B_A4B_CANVAS_LENGTH = 256


@dataclass(frozen=True, slots=True)
class ParamCount:
    """Parameters of a text stack: all of them, and those one token runs through (the experts
    count top_k / num_experts; the tied embedding counts once, as the LM head)."""

    total: int
    active: int


def preset_text_config(preset: str) -> dict[str, Any]:
    """The text_config dict a preset writes (the base tiny config with its overrides)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    return {**BASE_TEXT_CONFIG, **PRESETS[preset].text}


def estimate_parameters(text: dict[str, Any]) -> ParamCount:
    """Count the text stack's parameters from a text_config dict, without building it: the
    layer geometry is Canvas' own parse of the config (layer pattern, head dims, KV heads,
    v_proj). Norm weights are included; the vision tower is not."""
    from engine.model.config import parse_text_config

    cfg = parse_text_config(text)
    hidden, heads = cfg.hidden_size, cfg.num_heads
    dense = 3 * hidden * cfg.intermediate_size  # GeGLU gate, up, down
    expert = 3 * hidden * cfg.moe_intermediate_size
    total = active = 0
    for spec in cfg.layers:
        kv = (2 if spec.has_v_proj else 1) * hidden * spec.num_kv_heads * spec.head_dim
        attention = 2 * hidden * heads * spec.head_dim + kv
        router = hidden * cfg.num_experts + hidden + cfg.num_experts
        norms = 7 * hidden + 2 * spec.head_dim
        shared = attention + dense + router + norms
        total += shared + cfg.num_experts * expert
        active += shared + cfg.top_k_experts * expert
    embed = cfg.vocab_size * hidden
    self_conditioning = dense + hidden
    rest = embed + self_conditioning + hidden  # + the final norm
    return ParamCount(total + rest, active + rest)


def build_tokenizer(vocab_size: int, vision: bool = False) -> Any:
    """A byte-level tokenizer that works offline, padded with unused tokens to `vocab_size`
    (`vision`: with the image markup tokens after the chat markup)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    markup = MARKUP_TOKENS + (VISION_TOKENS if vision else ())
    tokens = list(SPECIAL_TOKENS) + alphabet + list(markup)
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
        additional_special_tokens=list(SPECIAL_TOKENS[4:] + markup),
        **(VISION_TOKEN_NAMES if vision else {}),
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


def _perturb_vision(model: Any, seed: int) -> None:
    """Non-trivial vision-tower weights: norms around 1, the position table and projections
    scaled to keep activations O(1) (a separate stream: the text weights stay the preset's)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision" not in name:
                continue
            if param.ndim == 1:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)


def make_tiny(
    out_dir: str | Path,
    preset: str = DEFAULT_PRESET,
    seed: int = 0,
    text_overrides: dict[str, Any] | None = None,
    vision: bool = False,
    canvas_length: int | None = None,
) -> Path:
    """Write a tiny checkpoint for `preset` (its text_config updated with `text_overrides`, for
    a config variant under test) into `out_dir` and return the path. `vision`: with a working
    vision tower, image tokens and an image processor config (see TINY_VISION_TEST_CONFIG),
    and, as the real model, `use_bidirectional_attention: "vision"` (image tokens attend to
    their whole image; `text_overrides={"use_bidirectional_attention": None}`: causally).
    `canvas_length`: instead of the preset's (the parity sweep's random configurations)."""
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
        EntropyBoundSamplerConfig,
    )

    from engine.params import DecodingDefaults

    both_ways = {"use_bidirectional_attention": "vision"} if vision else {}
    text = {**preset_text_config(preset), **both_ways, **(text_overrides or {})}
    spec = PRESETS[preset]
    image_ids: dict[str, Any] = {}
    if vision:
        first = len(SPECIAL_TOKENS) + 256 + len(MARKUP_TOKENS)  # after the chat markup
        names = ("boi_token_id", "image_token_id", "eoi_token_id")
        image_ids = {name: first + i for i, name in enumerate(names)}
    config = DiffusionGemmaConfig(
        text_config=text,
        vision_config=dict(TINY_VISION_TEST_CONFIG if vision else TINY_VISION_CONFIG),
        canvas_length=canvas_length or spec.canvas_length,
        **image_ids,
    )
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config)
    _perturb(model, spec, seed)
    if vision:
        _perturb_vision(model, seed)
    defaults = DecodingDefaults()  # the reference's generation defaults
    model.generation_config = DiffusionGemmaGenerationConfig(
        max_new_tokens=defaults.max_new_tokens,
        max_denoising_steps=defaults.max_denoising_steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=defaults.entropy_bound),
        t_min=defaults.t_min,
        t_max=defaults.t_max,
        stability_threshold=defaults.stability_threshold,
        confidence_threshold=defaults.confidence_threshold,
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        bos_token_id=text["bos_token_id"],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    build_tokenizer(text["vocab_size"], vision).save_pretrained(out)
    if vision:
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil,
        )

        patch_size = TINY_VISION_TEST_CONFIG["patch_size"]
        processor = Gemma4ImageProcessorPil(
            patch_size=patch_size, max_soft_tokens=TINY_MAX_SOFT_TOKENS
        )
        processor.save_pretrained(out)
    return out
