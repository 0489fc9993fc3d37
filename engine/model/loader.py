"""Checkpoint loader: a directory written by `DiffusionGemmaForBlockDiffusion.save_pretrained`.

Reads config.json and `model.safetensors` (or shards listed in `model.safetensors.index.json`),
memory-mapped through safetensors. Tied weights may be stored under the decoder's or the
encoder's name; both are accepted. The vision tower (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`) is loaded when config.json has a vision_config and the weights
hold it; a checkpoint without its tensors is served as text only. Every failure names the
tensor or key and what was expected.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from engine.device.cuda import select_device
from engine.model.adapter import ADAPTER_SUBDIR, CONFIG_FILE, load_adapter
from engine.model.base import DiffusionLM
from engine.model.config import CheckpointError, ModelConfig, parse_model_config
from engine.model.diffusion_gemma import DiffusionGemma
from engine.model.llama import LlamaDiffusion
from engine.model.per_expert import ExpertStack, find_stacks
from engine.model.quant import (
    SAFETENSORS_FP8,
    Fp8Choice,
    choose_fp8,
    make_fp8,
    read_layout,
    refuse_exact,
)
from kernels import resolve_kernels

logger = logging.getLogger(__name__)

# Canvas' vision-tower parameter prefixes → the checkpoint's.
VISION_PREFIXES = {
    "vision.tower.": "model.encoder.vision_tower.",
    "vision.projection.": "model.encoder.embed_vision.",
}
DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
PROGRESS_BAR_BYTES = 256 << 20
# The model registry: config.json's model_type → the backbone that parses and runs it.
BACKBONES: dict[str, type[DiffusionLM]] = {
    "diffusion_gemma": DiffusionGemma,
    "canvas_llama": LlamaDiffusion,
}

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES = ("auto", *DTYPES)  # every command's --dtype
DEVICE_HELP = "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse `model_dir/config.json` with its backbone's parser; raises CheckpointError naming
    the missing or bad key."""
    parsers = {name: backbone.parse_text_config for name, backbone in BACKBONES.items()}
    return parse_model_config(model_dir, parsers)


def resolve_device(name: str) -> str:
    """`auto`: cuda when a GPU is available, else cpu; any other name as is."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_dtype(name: str | None, config: ModelConfig) -> torch.dtype:
    """`auto` (or None) takes the checkpoint's declared dtype, else fp32."""
    if name in (None, "auto"):
        name = config.dtype or "float32"
    if name not in DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported; expected one of auto, {', '.join(DTYPES)}"
        )
    return DTYPES[name]


def checkpoint_names(name: str) -> list[str]:
    """Checkpoint keys that may hold the Canvas parameter `name`, in order of preference."""
    for ours, theirs in VISION_PREFIXES.items():
        if name.startswith(ours):
            return [theirs + name[len(ours) :]]
    if name.endswith("encoder_layer_scalar"):
        return [ENCODER + name.replace("encoder_layer_scalar", "layer_scalar")]
    if name.endswith("decoder_layer_scalar"):
        return [DECODER + name.replace("decoder_layer_scalar", "layer_scalar")]
    names = [DECODER + name]
    if not name.startswith("self_conditioning."):
        names.append(ENCODER + name)
    if name == "embed_tokens.weight":
        names.append("lm_head.weight")
    return names


def weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: no valid 'weight_map' ({exc})") from None
        files = sorted({model_dir / shard for shard in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {f.name} is listed but missing")
        return files
    raise CheckpointError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json (weights missing)"
    )


class _Tensors:
    """Key → (file handle) over all shards, opened memory-mapped; with `stacks`, the fused
    expert tensors the checkpoint holds one tensor per expert (`engine.model.per_expert`),
    which stand in for their parts."""

    def __init__(self, files: list[Path], stack: ExitStack) -> None:
        self.where: dict[str, object] = {}
        self.stacks: dict[str, ExpertStack] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except SafetensorError as exc:  # its message names no file
                raise CheckpointError(
                    f"{path}: not a complete safetensors file ({exc}); it may be truncated: "
                    "download or convert it again"
                ) from None
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                self.where[key] = handle

    def __contains__(self, key: str) -> bool:
        return key in self.where or key in self.stacks

    def keys(self) -> Iterator[str]:
        parts = {key for s in self.stacks.values() for expert in s.parts for key in expert}
        yield from (key for key in self.where if key not in parts)
        yield from self.stacks

    def meta(self, key: str) -> tuple[list[int], str]:
        if key in self.stacks:
            return list(self.stacks[key].shape), self.stacks[key].dtype
        sl = self.where[key].get_slice(key)  # type: ignore[attr-defined]
        return list(sl.get_shape()), sl.get_dtype()

    def get(self, key: str, device: str = "cpu") -> torch.Tensor:
        """The tensor of `key`: memory-mapped as stored, or a stack read onto `device`."""
        if key in self.stacks:
            return self.stacks[key].read(self.get, device)
        return self.where[key].get_tensor(key)  # type: ignore[attr-defined]


SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def load_model(
    model_dir: str | Path,
    dtype: str | None = "auto",
    device: str | torch.device = "cpu",
    exact: bool = False,
    kernels: str = "auto",
    adapter: str | Path | bool = True,
    quantization: str = "auto",
) -> DiffusionLM:
    """Build the Canvas model from a checkpoint directory, with its kernel set bound: `exact`
    numerics or fast ones, on the `kernels` backend (`kernels.BACKENDS`), on `device`
    ("auto": cuda when available). `adapter`: a decoder adapter directory to attach
    (`engine.model.adapter`); True: the checkpoint's own `adapter/` when it has one; False:
    none. `quantization` (`engine.model.quant`): "auto" loads the weights as stored (an FP8
    checkpoint's as FP8), "fp8" quantizes a floating-point checkpoint's projections and experts
    per output channel, one tensor at a time on `device`. FP8 refuses `exact` (ValueError)."""
    model_dir = Path(model_dir)
    device = resolve_device(str(device))
    if torch.device(device).type == "cpu":
        keep_freed_memory()
    select_device(device)  # Triton launches on the current device: make it this one
    config = load_model_config(model_dir)
    target = resolve_dtype(dtype, config)
    layout = read_layout(model_dir)
    fp8_source = "--quantization fp8" if quantization == "fp8" else None
    refuse_exact(exact, "an FP8 checkpoint" if layout is not None else fp8_source)
    with ExitStack() as stack:
        tensors = _Tensors(weight_files(model_dir), stack)
        experts = config.text.num_experts
        tensors.stacks = find_stacks(tensors.where.keys(), tensors.meta, experts, layout)
        config = _with_vision_weights(config, tensors)
        with torch.device("meta"):
            model = BACKBONES[config.model_type](config)
        fp8 = choose_fp8(model, functools.partial(_stored, tensors), layout, quantization)
        make_fp8(model, fp8.stored | fp8.quantized)
        expected = dict(model.state_dict())
        plan = _plan(tensors, expected, config, fp8)
        total = sum(_nbytes(tensors, key) for key in plan.values())
        state = {}
        bar = tqdm(
            plan.items(),
            total=len(plan),
            desc="Loading weights",
            unit="tensor",
            disable=total < PROGRESS_BAR_BYTES,
        )
        for name, key in bar:
            # Kept as views into the memory-mapped file when no cast is needed (as transformers
            # does): CPU GEMM results depend on operand alignment in the last bit, and matching
            # the reference bit for bit needs the same memory layout.
            state.update(fp8.load(name, tensors.get(key, device), device, target))
    model.load_state_dict(state, assign=True, strict=True)
    model.init_rope(device)  # non-persistent buffers were created on the meta device
    model.bind_kernels(resolve_kernels(torch.device(device).type, kernels, exact))
    adapter_dir = resolve_adapter(model_dir, adapter)
    if adapter_dir is not None:
        load_adapter(model, adapter_dir)
        logger.info("Attached the decoder adapter from %s", adapter_dir)
    return model.eval().requires_grad_(False)


# glibc's mallopt parameters (malloc.h) and the values Canvas sets on CPU.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HOST_MALLOC = {_M_MMAP_THRESHOLD: 32 << 20, _M_TRIM_THRESHOLD: 512 << 20, _M_TOP_PAD: 64 << 20}


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (once per process; CPU serving).

    A CPU forward allocates and frees hundreds of activation buffers of 0.1-10 MB. By default
    glibc serves each from a fresh mmap and unmaps it on free, so every buffer's pages fault
    in again at first touch (a measurable share of a small model's step). Taken from the heap
    below 32 MB and trimmed only past 512 MB, they are reused warm. Returns False where the C
    library is not glibc (nothing changes there)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in _HOST_MALLOC.items())


def resolve_adapter(model_dir: Path, adapter: str | Path | bool) -> Path | None:
    """The adapter directory `load_model` attaches (see its `adapter` argument)."""
    if adapter is False:
        return None
    if adapter is True:
        own = model_dir / ADAPTER_SUBDIR
        return own if (own / CONFIG_FILE).is_file() else None
    path = Path(adapter)
    if not path.is_dir():
        raise CheckpointError(f"--adapter {path}: not a directory")
    return path


def _nbytes(tensors: _Tensors, key: str) -> int:
    shape, dtype = tensors.meta(key)
    numel = 1
    for d in shape:
        numel *= d
    return numel * {"F32": 4, SAFETENSORS_FP8: 1}.get(dtype, 2)


def _stored(tensors: _Tensors, name: str) -> tuple[str, str] | None:
    """The checkpoint key and safetensors dtype that hold Canvas parameter `name`."""
    key = next((c for c in checkpoint_names(name) if c in tensors), None)
    return None if key is None else (key, tensors.meta(key)[1])


def _plan(
    tensors: _Tensors, expected: dict[str, torch.Tensor], config: ModelConfig, fp8: Fp8Choice
) -> dict[str, str]:
    """Map each Canvas parameter to a checkpoint key, checking shape and dtype (FP8 weights
    as F8_E4M3, their scales in any floating-point dtype)."""
    available = set(tensors.keys())
    plan: dict[str, str] = {}
    for name, param in expected.items():
        if name in fp8.made_scales:
            continue
        candidates = checkpoint_names(name)
        key = next((c for c in candidates if c in available), None)
        if key is None:
            raise CheckpointError(f"missing tensor {candidates[0]} (shape {list(param.shape)})")
        shape, st_dtype = tensors.meta(key)
        if shape != list(param.shape):
            raise CheckpointError(
                f"tensor {key} has shape {shape}, expected {list(param.shape)} from config.json"
            )
        plan[name] = key
        if name in fp8.stored:  # F8_E4M3, as `choose_fp8` found it
            continue
        if st_dtype == SAFETENSORS_FP8:
            raise CheckpointError(
                f"tensor {key} is {SAFETENSORS_FP8}, but Canvas runs {name} unquantized (only "
                "attention, MLP and expert projections may be FP8, all of a module or none)"
            )
        dtype = SAFETENSORS_DTYPES.get(st_dtype)
        own = config.dtype in DTYPES and name not in fp8.scales  # a scale: any float dtype
        if dtype is None or (own and dtype != config.dtype):
            want = config.dtype if config.dtype in DTYPES else "a floating-point dtype"
            raise CheckpointError(f"tensor {key} has dtype {st_dtype}, expected {want}")
    used = set(plan.values())
    tied = {c for name in expected for c in checkpoint_names(name)}
    unknown = sorted(available - used - tied)
    if unknown:
        logger.warning("Ignoring %d unrecognised tensors, e.g. %s", len(unknown), unknown[:3])
    return plan


def _with_vision_weights(config: ModelConfig, tensors: _Tensors) -> ModelConfig:
    """`config` as served: without its vision tower when the weights do not hold one (a
    text-only export); a vision-tower tensor without a vision_config is left unrecognised."""
    if config.vision is None:
        return config
    prefixes = tuple(VISION_PREFIXES.values())
    if any(key.startswith(prefixes) for key in tensors.keys()):  # noqa: SIM118 (not a dict)
        return config
    logger.info("config.json has a vision_config but the weights no vision tower: text only")
    return dataclasses.replace(config, vision=None)


def save_weights(model: DiffusionLM, path: str | Path) -> None:
    """Write the model's weights as a safetensors file in the checkpoint layout `load_model`
    reads (each tensor under its first checkpoint name, e.g. `model.decoder.layers.0...`)."""
    from safetensors.torch import save_file

    tensors = {
        checkpoint_names(name)[0]: t.detach().contiguous().cpu()
        for name, t in model.state_dict().items()
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
