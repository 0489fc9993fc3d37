"""Canvas engine: the DiffusionGemma model, the diffusion sampler and the offline LLM API."""

from engine.llm import LLM, RequestOutput
from engine.params import DecodeMode, ParamError, SamplingParams

__all__ = ["LLM", "DecodeMode", "ParamError", "RequestOutput", "SamplingParams"]
