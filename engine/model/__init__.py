"""Block-diffusion models: config parsing, the backbones (DiffusionGemma, converted Llama-style
stacks), the paged KV cache, the checkpoint loader."""

from engine.model.base import DiffusionLM
from engine.model.config import CheckpointError, ModelConfig, load_model_config
from engine.model.diffusion_gemma import DiffusionGemma
from engine.model.kv_cache import ForwardBatch, Mode, PagedKVCache, Row, TrainKVCache
from engine.model.llama import LlamaDiffusion
from engine.model.loader import load_model, save_weights

__all__ = [
    "CheckpointError",
    "DiffusionGemma",
    "DiffusionLM",
    "LlamaDiffusion",
    "ForwardBatch",
    "ModelConfig",
    "Mode",
    "PagedKVCache",
    "Row",
    "TrainKVCache",
    "load_model",
    "load_model_config",
    "save_weights",
]
