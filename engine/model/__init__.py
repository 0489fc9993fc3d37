"""The DiffusionGemma model: config parsing, the native text stack, the checkpoint loader."""

from engine.model.config import CheckpointError, ModelConfig, load_model_config
from engine.model.diffusion_gemma import DiffusionGemma
from engine.model.kv_cache import ForwardBatch, Mode, PagedKVCache, Row
from engine.model.loader import load_model

__all__ = [
    "CheckpointError",
    "DiffusionGemma",
    "ForwardBatch",
    "ModelConfig",
    "Mode",
    "PagedKVCache",
    "Row",
    "load_model",
    "load_model_config",
]
