"""The DiffusionGemma model: config parsing, the native text stack, the checkpoint loader."""

from engine.model.config import CheckpointError, ModelConfig, load_model_config
from engine.model.diffusion_gemma import DiffusionGemma
from engine.model.kv_cache import DenseKVCache, ForwardBatch, KVCache, Mode
from engine.model.loader import load_model

__all__ = [
    "CheckpointError",
    "DenseKVCache",
    "DiffusionGemma",
    "ForwardBatch",
    "KVCache",
    "ModelConfig",
    "Mode",
    "load_model",
    "load_model_config",
]
