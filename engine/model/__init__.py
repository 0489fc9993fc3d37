"""Block-diffusion models: config parsing, the backbones (DiffusionGemma, converted Llama-style
stacks) and their registry, the paged KV cache, the checkpoint loader. Inference only: training
lives in `engine.adapt`."""

from engine.model.base import DiffusionLM
from engine.model.config import CheckpointError, ModelConfig
from engine.model.diffusion_gemma import DiffusionGemma
from engine.model.kv_cache import ForwardBatch, Mode, PagedKVCache, Row
from engine.model.llama import LlamaDiffusion
from engine.model.loader import BACKBONES, load_model, load_model_config, save_weights

__all__ = [
    "BACKBONES",
    "CheckpointError",
    "DiffusionGemma",
    "DiffusionLM",
    "LlamaDiffusion",
    "ForwardBatch",
    "ModelConfig",
    "Mode",
    "PagedKVCache",
    "Row",
    "load_model",
    "load_model_config",
    "save_weights",
]
