"""Model configuration: the text stack of a DiffusionGemma checkpoint, parsed from config.json.

Canvas parses config.json itself (no transformers config classes at run time) into frozen
dataclasses. The rules mirror `transformers.models.diffusion_gemma.configuration_diffusion_gemma`:
full-attention layers take `global_head_dim` and `num_global_key_value_heads` (or the explicit
`per_layer_config` that `save_pretrained` writes), sliding layers keep `head_dim` and
`num_key_value_heads`, and full layers have no v_proj (V is the k_proj output, k_eq_v).

Which backbone parses a checkpoint's text_config is the model registry's business
(`engine.model.loader.BACKBONES`: model_type → backbone class, each with its parser).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SLIDING_PATTERN = 6  # without layer_types: every sixth layer is full attention (5:1)


class CheckpointError(ValueError):
    """A checkpoint directory that Canvas cannot load; the message names the file, key or tensor."""


class LayerType(str, Enum):
    SLIDING = "sliding_attention"
    FULL = "full_attention"


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding of one layer type: `rope_type` is "default" or "proportional"."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Attention geometry of one layer."""

    layer_type: LayerType
    head_dim: int
    num_kv_heads: int
    has_v_proj: bool  # DiffusionGemma: False on full layers (V is the raw k_proj output)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type is LayerType.SLIDING


@dataclass(frozen=True, slots=True)
class TextConfig:
    """The DiffusionGemma text stack (shared by the encoder and decoder modes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    rope: dict[LayerType, RopeSpec]
    sliding_window: int
    rms_norm_eps: float
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    final_logit_softcapping: float | None
    hidden_activation: str
    max_position_embeddings: int
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Backbone switches (DiffusionGemma's values by default)
    embed_scale: bool = True  # embeddings × sqrt(hidden)
    qk_norm: bool = True  # weighted q/k RMSNorm and unweighted v RMSNorm in attention
    sc_post_norm: bool = True  # RMSNorm (no weight) after adding the self-conditioning signal
    attention_scale: float | None = 1.0  # None: 1 / sqrt(head_dim)

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise CheckpointError(
                f"text_config: layer_types has {len(self.layers)} entries, expected "
                f"num_hidden_layers={self.num_layers}"
            )
        for i, spec in enumerate(self.layers):
            if self.num_heads % spec.num_kv_heads:
                raise CheckpointError(
                    f"text_config: layer {i} has {spec.num_kv_heads} KV heads, which does not "
                    "divide "
                    f"num_attention_heads={self.num_heads}"
                )
        if self.top_k_experts > self.num_experts:
            raise CheckpointError(
                f"text_config: top_k_experts={self.top_k_experts} exceeds "
                f"num_experts={self.num_experts}"
            )
        if self.hidden_activation not in ("gelu_pytorch_tanh", "silu"):
            raise CheckpointError(
                f"text_config.hidden_activation={self.hidden_activation!r} is not supported; "
                "expected 'gelu_pytorch_tanh' or 'silu'"
            )


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """DiffusionGemma's vision tower (Gemma 4's `gemma4_vision`) and the token ids that mark
    images in a prompt: each image is `boi_token_id`, then one `image_token_id` per soft token
    (whose embedding the tower's output replaces), then `eoi_token_id`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_activation: str
    rms_norm_eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    # text_config.use_bidirectional_attention == "vision": the encoder's image tokens attend to
    # their whole image, both ways (`RequestState.image_spans`, `PagedRows.span`); the decoder
    # and every later encoder pass stay as they are.
    bidirectional: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"vision_config: num_key_value_heads={self.num_kv_heads} does not divide "
                f"num_attention_heads={self.num_heads}"
            )
        if self.head_dim % 4:
            raise CheckpointError(
                f"vision_config: head_dim={self.head_dim} must be a multiple of 4 (2-D RoPE)"
            )
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise CheckpointError(
                f"vision_config.hidden_activation={self.hidden_activation!r} is not supported; "
                "expected 'gelu_pytorch_tanh'"
            )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything Canvas needs from config.json."""

    model_type: str
    text: TextConfig
    canvas_length: int
    dtype: str | None  # the checkpoint's declared torch dtype name, e.g. "bfloat16"
    vision: VisionConfig | None = None  # None: a text-only checkpoint

    def __post_init__(self) -> None:
        if self.canvas_length <= 0:
            raise CheckpointError(f"canvas_length must be positive, got {self.canvas_length}")


def parse_vision_config(raw: dict[str, Any]) -> VisionConfig | None:
    """The vision tower of a DiffusionGemma config.json (its `vision_config` and the image
    token ids, with the reference's defaults); None when it has no vision_config."""
    vc = raw.get("vision_config")
    if vc is None:
        return None
    where = "config.json vision_config"
    if not isinstance(vc, dict):
        raise CheckpointError(f"{where}: must be an object")
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise CheckpointError(f"{where}.rope_parameters.rope_type must be 'axial'")
    hidden = int(_require(vc, "hidden_size", where))
    heads = int(vc.get("num_attention_heads", 12))
    return VisionConfig(
        hidden_size=hidden,
        intermediate_size=int(_require(vc, "intermediate_size", where)),
        num_layers=int(_require(vc, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(vc.get("num_key_value_heads", heads)),
        head_dim=int(vc.get("head_dim") or hidden // heads),
        hidden_activation=vc.get("hidden_activation", "gelu_pytorch_tanh"),
        rms_norm_eps=float(vc.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        pooling_kernel_size=int(vc.get("pooling_kernel_size", 3)),
        patch_size=int(vc.get("patch_size", 16)),
        position_embedding_size=int(vc.get("position_embedding_size", 10 * 1024)),
        use_clipped_linears=bool(vc.get("use_clipped_linears", False)),
        standardize=bool(vc.get("standardize", False)),
        image_token_id=int(raw.get("image_token_id", 258_880)),
        boi_token_id=int(raw.get("boi_token_id", 255_999)),
        eoi_token_id=int(raw.get("eoi_token_id", 258_882)),
        bidirectional=(raw.get("text_config") or {}).get("use_bidirectional_attention") == "vision",
    )


def load_vision_config(model_dir: str | Path) -> VisionConfig | None:
    """The vision tower of `model_dir/config.json` (None: text only); CheckpointError for a bad
    file."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    return parse_vision_config(raw) if isinstance(raw, dict) else None


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise CheckpointError(f"{where}: missing required key {key!r}")
    return cfg[key]


def _rope_specs(raw: dict[str, Any] | None) -> dict[LayerType, RopeSpec]:
    defaults = {
        LayerType.SLIDING: RopeSpec("default", 10_000.0),
        LayerType.FULL: RopeSpec("proportional", 1_000_000.0, partial_rotary_factor=0.25),
    }
    if raw is None:
        return defaults
    specs = {}
    for layer_type in LayerType:
        params = raw.get(layer_type.value)
        if params is None:
            specs[layer_type] = defaults[layer_type]
            continue
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise CheckpointError(
                f"text_config.rope_parameters.{layer_type.value}.rope_type={rope_type!r} is not "
                "supported; expected 'default' or 'proportional'"
            )
        specs[layer_type] = RopeSpec(
            rope_type=rope_type,
            theta=float(params["rope_theta"]),
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
            factor=float(params.get("factor", 1.0)),
        )
    return specs


def _layer_specs(tc: dict[str, Any], layer_types: list[str]) -> tuple[LayerSpec, ...]:
    head_dim = int(tc.get("head_dim", 256))
    num_kv = int(tc.get("num_key_value_heads", 4))
    per_layer = {int(k): v for k, v in (tc.get("per_layer_config") or {}).items()}
    if not per_layer:
        # Same derivation as DiffusionGemmaTextConfig.__post_init__ for configs without the
        # explicit per-layer table.
        override: dict[str, Any] = {"head_dim": int(tc.get("global_head_dim", 512))}
        # DiffusionGemma removes Gemma 4's `attention_k_eq_v`: its full layers always share K
        # and V and take `num_global_key_value_heads` (the reference reads the key before it
        # is set, so a stored value changes nothing).
        global_kv = tc.get("num_global_key_value_heads")
        if global_kv is not None:
            override["num_key_value_heads"] = int(global_kv)
        per_layer = {i: override for i, t in enumerate(layer_types) if t == LayerType.FULL.value}
    if tc.get("attention_k_eq_v") is False:
        logger.warning(
            "text_config.attention_k_eq_v=false is ignored, as by the reference: "
            "DiffusionGemma's full-attention layers have no v_proj (V is the k_proj output)"
        )
    specs = []
    for i, name in enumerate(layer_types):
        try:
            layer_type = LayerType(name)
        except ValueError:
            raise CheckpointError(
                f"text_config.layer_types[{i}]={name!r}; expected 'sliding_attention' or "
                "'full_attention'"
            ) from None
        override = per_layer.get(i, {})
        specs.append(
            LayerSpec(
                layer_type=layer_type,
                head_dim=int(override.get("head_dim", head_dim)),
                num_kv_heads=int(override.get("num_key_value_heads", num_kv)),
                has_v_proj=layer_type is LayerType.SLIDING,
            )
        )
    return tuple(specs)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def default_layer_types(num_layers: int) -> list[str]:
    """The layer pattern of a config without `layer_types`: five sliding layers, then one full,
    repeated; the last layer is always full."""
    types = [
        LayerType.SLIDING.value if (i + 1) % SLIDING_PATTERN else LayerType.FULL.value
        for i in range(num_layers)
    ]
    types[-1] = LayerType.FULL.value
    return types


def parse_text_config(tc: dict[str, Any]) -> TextConfig:
    """DiffusionGemma's text_config."""
    where = "config.json text_config"
    num_layers = int(_require(tc, "num_hidden_layers", where))
    layer_types = list(tc.get("layer_types") or default_layer_types(num_layers))
    layer_types[-1] = LayerType.FULL.value  # the reference forces the last layer to full
    if tc.get("use_bidirectional_attention") == "all":
        raise CheckpointError(
            f"{where}: use_bidirectional_attention='all' (a non-causal encoder) is not supported"
        )
    return TextConfig(
        vocab_size=int(_require(tc, "vocab_size", where)),
        hidden_size=int(_require(tc, "hidden_size", where)),
        intermediate_size=int(_require(tc, "intermediate_size", where)),
        num_layers=num_layers,
        num_heads=int(_require(tc, "num_attention_heads", where)),
        layers=_layer_specs(tc, layer_types),
        rope=_rope_specs(tc.get("rope_parameters")),
        sliding_window=int(tc.get("sliding_window", 512)),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        num_experts=int(_require(tc, "num_experts", where)),
        top_k_experts=int(_require(tc, "top_k_experts", where)),
        moe_intermediate_size=int(_require(tc, "moe_intermediate_size", where)),
        final_logit_softcapping=tc.get("final_logit_softcapping", 30.0),
        hidden_activation=tc.get("hidden_activation", "gelu_pytorch_tanh"),
        max_position_embeddings=int(tc.get("max_position_embeddings", 131_072)),
        pad_token_id=tc.get("pad_token_id", 0),
        eos_token_ids=_token_ids(tc.get("eos_token_id", 1)),
        bos_token_id=tc.get("bos_token_id", 2),
    )


def parse_llama_text_config(tc: dict[str, Any]) -> TextConfig:
    """A Llama-style backbone (converted from an AR checkpoint): every layer full attention with
    its own v_proj, SwiGLU MLP, default RoPE, no MoE, no soft-capping, unscaled embeddings."""
    where = "config.json text_config"
    num_layers = int(_require(tc, "num_hidden_layers", where))
    num_heads = int(_require(tc, "num_attention_heads", where))
    hidden = int(_require(tc, "hidden_size", where))
    head_dim = int(tc.get("head_dim") or hidden // num_heads)
    num_kv = int(tc.get("num_key_value_heads") or num_heads)
    max_pos = int(tc.get("max_position_embeddings", 8192))
    spec = LayerSpec(LayerType.FULL, head_dim, num_kv, has_v_proj=True)
    return TextConfig(
        vocab_size=int(_require(tc, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_require(tc, "intermediate_size", where)),
        num_layers=num_layers,
        num_heads=num_heads,
        layers=(spec,) * num_layers,
        rope={LayerType.FULL: RopeSpec("default", float(tc.get("rope_theta", 10_000.0)))},
        sliding_window=max_pos,
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        num_experts=0,
        top_k_experts=0,
        moe_intermediate_size=0,
        final_logit_softcapping=None,
        hidden_activation=tc.get("hidden_activation", "silu"),
        max_position_embeddings=max_pos,
        pad_token_id=tc.get("pad_token_id"),
        eos_token_ids=_token_ids(tc.get("eos_token_id")),
        bos_token_id=tc.get("bos_token_id"),
        embed_scale=False,
        qk_norm=False,
        sc_post_norm=False,
        attention_scale=None,
    )


def parse_model_config(
    model_dir: str | Path, parsers: dict[str, Callable[[dict[str, Any]], TextConfig]]
) -> ModelConfig:
    """Parse `model_dir/config.json` with the text_config parser of its model_type (`parsers`:
    model_type → parser); raises CheckpointError naming the missing or bad key."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found (is this a checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    model_type = raw.get("model_type")
    if model_type not in parsers:
        raise CheckpointError(
            f"{path}: model_type={model_type!r} is not supported; expected one of {list(parsers)}"
        )
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: missing required key 'text_config'")
    return ModelConfig(
        model_type=model_type,
        text=parsers[model_type](text),
        canvas_length=int(raw.get("canvas_length", 256)),
        dtype=raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype"),
        vision=parse_vision_config(raw),
    )
