"""Canvas engine: the DiffusionGemma model, the diffusion sampler and the offline LLM API.

Names load lazily (PEP 562), so that `import engine.types` or `import engine.params` — the
torch-free contract the server uses — never loads torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput
    from engine.params import DecodeMode, ParamError, SamplingParams

__all__ = ["LLM", "DecodeMode", "ParamError", "RequestOutput", "SamplingParams"]

_HOMES = {
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "DecodeMode": "engine.params",
    "ParamError": "engine.params",
    "SamplingParams": "engine.params",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
