"""The one build path: open a checkpoint, build an engine.

    checkpoint = open_checkpoint(config.checkpoint)      # model, tokenizer, DecodingDefaults
    engine = build_engine(checkpoint, config.engine)      # Engine

`canvas serve`, `canvas generate`, `LLM`, training and the GPU benchmark all build here. One
record describes a build: `BuildConfig`, the checkpoint and how its model is loaded
(`CheckpointConfig`) beside the engine's own configuration (`EngineConfig`, the scheduler's
inside it). The command line maps its flags onto these fields (`server.cli.config`), and
`LLM.from_pretrained`'s arguments are the same fields.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.checkpoints.default import default_model_dir
from engine.checkpoints.hub import locate
from engine.device.cpu_dtype import auto_dtype
from engine.engine import Engine, EngineConfig
from engine.inputs.images import ImageProcessor
from engine.inputs.tokenizer import Tokenizer
from engine.model import DiffusionLM, load_model
from engine.parallel.ranks import Ranks
from engine.parallel.serving import check_tensor_parallel, serve_ranks, start_ranks
from engine.params import DecodingDefaults

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """Which checkpoint to open and how its model is loaded (`engine.model.load_model`):
    `model_dir`: a directory, or a hub id `org/name[@revision]` downloaded into `download_dir`
    (None: huggingface_hub's cache; `engine.checkpoints.hub`: an existing path wins), None
    the built-in default model (`engine.checkpoints.default`); `device` "auto"
    is cuda when available; `exact`: reference-exact numerics instead of the fast batched ones;
    `kernels`: a backend of `kernels.BACKENDS`; `adapter`: a decoder adapter directory, True
    for the checkpoint's own (if any), False for none. `generation_config`: where the decoding
    defaults come from (`engine.params.generation_config`: `auto`, the checkpoint's; `canvas`,
    Canvas's; `vllm`, Canvas's with no max_new_tokens; or a directory),
    `override_generation_config`: generation_config.json keys set on top of them.
    `quantization`: "auto" (the weights as stored) or "fp8" (`engine.model.quant`).
    `tensor_parallel_size`: ranks the model is split over (`engine.parallel.serving`: rank 0
    here, the others spawned), its experts whole with `expert_parallel`; `distributed_port`:
    the world's (0: $MASTER_PORT, else a free one)."""

    model_dir: str | Path | None = None
    dtype: str = "auto"
    device: str = "auto"
    exact: bool = False
    kernels: str = "auto"
    adapter: str | Path | bool = True
    generation_config: str | Path = "auto"
    override_generation_config: dict[str, Any] | None = None
    download_dir: Path | None = None
    quantization: str = "auto"
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    distributed_port: int = 0

    def __post_init__(self) -> None:
        check_tensor_parallel(self)


@dataclass(frozen=True, slots=True)
class BuildConfig:
    """Everything one engine is built from."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An opened checkpoint: its model with the kernel set bound, its tokenizer (None: the
    checkpoint has none, prompts are token ids) and its decoding defaults. `model_dir`: where
    it was read from (None: a model built without one, as the GPU benchmark's); `name`: what
    clients call it unless told otherwise, the hub id without its revision or the directory's
    name; `image_processor`: its image preprocessing, where it has a vision tower and a
    processor config (the engine's warm-up prepares its image with it, as a client's);
    `ranks`: the other ranks of a parallel model, which `build_engine` makes it lead."""

    model: DiffusionLM
    tokenizer: Tokenizer | None
    defaults: DecodingDefaults
    model_dir: Path | None = None
    name: str | None = None
    image_processor: ImageProcessor | None = None
    ranks: Ranks | None = None


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def adapter_choice(text: str) -> str | bool:
    """`CheckpointConfig.adapter` from its text form: `auto` (True: the checkpoint's own
    adapter/ when it has one), `none` (False), or a directory."""
    return {"auto": True, "none": False}.get(text, text)


def open_checkpoint(config: CheckpointConfig) -> Checkpoint:
    """Load `config`'s checkpoint, first downloading a hub id; raises CheckpointError (or
    ValueError, OSError) naming the file or setting at fault, HubError naming a hub id that
    cannot be had, and DefaultModelMissing when the built-in model is asked for and cannot be
    built."""
    if config.model_dir is None:
        model_dir = default_model_dir()
        name = model_dir.name
    else:
        model_dir, name = locate(config.model_dir, config.download_dir)
    dtype = auto_dtype(model_dir, config.dtype, config.device, config.exact, config.quantization)
    ranks = None
    if config.tensor_parallel_size > 1:
        model, ranks = start_ranks(model_dir, dataclasses.replace(config, dtype=dtype))
    else:
        model = load_model(
            model_dir,
            dtype=dtype,
            device=config.device,
            exact=config.exact,
            kernels=config.kernels,
            adapter=config.adapter,
            quantization=config.quantization,
        )
    tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
    defaults = DecodingDefaults.from_checkpoint(
        model_dir,
        model.cfg.eos_token_ids,
        config.generation_config,
        config.override_generation_config,
    )
    images = image_processor(model_dir) if model.vision is not None else None
    return Checkpoint(model, tokenizer, defaults, model_dir, name, images, ranks)


def image_processor(model_dir: Path) -> ImageProcessor | None:
    """The image preprocessing of a checkpoint with a vision tower; None (logged) when it has
    no usable processor config."""
    try:
        return ImageProcessor(model_dir)
    except ValueError as exc:
        logger.info("no image preprocessing (the warm-up sends no image): %s", exc)
        return None


def build_engine(checkpoint: Checkpoint, config: EngineConfig | None = None) -> Engine:
    """The engine that runs `checkpoint` as `config` (None: the defaults) describes, sized by
    its memory plan (logged; `engine.device.memory`: MemoryPlanError naming the flags when the
    device cannot hold one canvas)."""
    model, images = checkpoint.model, checkpoint.image_processor
    engine = Engine(model, checkpoint.defaults, config, checkpoint.tokenizer, images)
    serve_ranks(checkpoint.ranks, engine)  # a parallel model's: lead its other ranks
    logger.info("%s", engine.plan.describe())
    return engine


def build(config: BuildConfig) -> tuple[Checkpoint, Engine]:
    """Open `config`'s checkpoint and build its engine."""
    checkpoint = open_checkpoint(config.checkpoint)
    return checkpoint, build_engine(checkpoint, config.engine)
