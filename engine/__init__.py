"""Canvas engine: the DiffusionGemma model, the diffusion sampler and the offline LLM API.

Names load lazily (PEP 562), so that `import engine.types` or `import engine.params` — the
torch-free contract the server uses — never loads torch.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM, RequestOutput
    from engine.params import DecodeMode, ParamError, SamplingParams


def _check_kernels_package() -> None:
    """Canvas' kernel package is the top-level module `kernels`, and so is Hugging Face's
    `kernels` distribution (a dependency of transformers >= 5.25, which pyproject excludes).
    Where that one is installed and comes first on the path, Canvas would import it and fail
    far from the cause; this names the cause instead. Finding a spec imports nothing."""
    spec = importlib.util.find_spec("kernels")
    ours = Path(__file__).resolve().parent.parent / "kernels"
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent == ours:
        return  # missing: the import itself says so
    raise ImportError(
        f"the module 'kernels' resolves to {spec.origin}, not Canvas' own package ({ours}): "
        "Hugging Face's `kernels` distribution is installed in this environment and shadows "
        "it (transformers >= 5.25 requires it; Canvas pins transformers < 5.25). Remove it "
        "with `pip uninstall kernels`."
    )


_check_kernels_package()

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
