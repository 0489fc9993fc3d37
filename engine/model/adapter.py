"""Decoder adapters: a small trainable part that turns a converted AR stack into a denoiser while
the encoder stays exactly the source.

An adapter acts on DECODE rows (canvases) only, so ENCODE rows (prefill, commit, AR tokens) are
bit for bit what they are without it:
- LoRA on the decoder's projections (q, k, v, o, gate, up, down): each projection's output on
  DECODE tokens gets `scale * B(A x)` added; ENCODE tokens are left untouched;
- a learned embedding per canvas position, added to the canvas embeddings (the decoder learns
  where in the canvas a slot is; a converted stack has no notion of it);
- the self-conditioning block's weights (DECODE-only by construction), replacing the
  checkpoint's freshly initialised ones;
- `shift`: canvas position i > 0 reads its logits off the final hidden state of position i - 1,
  as the source did in AR mode (Dream's shift: the AR prior is kept, not unlearned), and
  position 0 off the last position's (a rotation by one: the last state has no AR role inside
  the canvas, and no two positions share a state, so none repeats its neighbour's token).

On disk (a directory): `adapter_config.json`, `adapter.safetensors` (LoRA and position
embeddings) and `adapter_self_conditioning.safetensors`, each at most a few MiB for the default
model. `load_model(..., adapter=DIR)` attaches one; a checkpoint directory holding an `adapter/`
subdirectory gets it attached automatically.
"""

from __future__ import annotations

import filecmp
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.model.base import DiffusionLM
from engine.model.config import CheckpointError
from engine.model.kv_cache import ForwardBatch, Mode
from engine.model.layers import UNBOUND, Attention, GatedMLP, SelfConditioning
from engine.model.quant import FP8, SCALE_SUFFIX, quantize_fp8

CONFIG_FILE = "adapter_config.json"
LORA_FILE = "adapter.safetensors"
SELF_CONDITIONING_FILE = "adapter_self_conditioning.safetensors"
ADAPTER_SUBDIR = "adapter"  # a checkpoint's own adapter, attached by default
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    canvas_length: int
    rank: int = 8
    alpha: float = 16.0
    shift: bool = True

    def __post_init__(self) -> None:
        if self.rank < 1 or self.canvas_length < 1:
            raise ValueError("adapter rank and canvas_length must be >= 1")
        if self.alpha <= 0:
            raise ValueError("adapter alpha must be > 0")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def decode_rows(batch: ForwardBatch) -> tuple[bool, bool, list[int]]:
    """(any DECODE row, all rows DECODE, the DECODE rows' token counts in packing order)."""
    segments = [row.num_tokens for row in batch.rows if row.mode is Mode.DECODE]
    return bool(segments), len(segments) == len(batch.rows), segments


class LoraDelta(nn.Module):
    """The low-rank update of one projection, added on DECODE tokens only."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float) -> None:
        super().__init__()
        self.kernels = UNBOUND
        self.scale = scale
        self.lora_a = nn.Parameter(torch.zeros(rank, in_features))
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))  # zero: starts as a no-op

    def forward(self, x: torch.Tensor, y: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: the projection's input [1, N, In]; y: its output [1, N, Out]."""
        any_decode, all_decode, segments = decode_rows(batch)
        if not any_decode:
            return y
        linear = self.kernels.linear  # per-request GEMMs in exact numerics
        if all_decode:
            return y + linear(linear(x, self.lora_a, segments), self.lora_b, segments) * self.scale
        index = batch.decode_index(x.device)  # [num_decode_tokens]
        low = linear(x[:, index], self.lora_a, segments)
        return y.index_add(1, index, linear(low, self.lora_b, segments) * self.scale)


class DecoderAdapter(nn.Module):
    """The adapter's model-level parts (position embeddings, shift); the LoRA deltas live on
    the projections they adapt (`Attention.lora`, `GatedMLP.lora`)."""

    def __init__(self, config: AdapterConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.position_embeddings = nn.Parameter(torch.zeros(config.canvas_length, hidden_size))

    def embed(self, canvas: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """canvas: the DECODE tokens' embeddings [num_decode_tokens, H], rows of `segments`."""
        self._check(segments)
        length = self.config.canvas_length
        return (canvas.view(-1, length, canvas.shape[-1]) + self.position_embeddings).view(
            canvas.shape
        )

    def shift(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [N, H] with each canvas's states rotated right by one: position
        i takes position i - 1's, position 0 the last position's."""
        any_decode, all_decode, segments = decode_rows(batch)
        if not self.config.shift or not any_decode:
            return hidden
        self._check(segments)
        index = None if all_decode else batch.decode_index(hidden.device)
        canvas = hidden if index is None else hidden[index]
        rows = canvas.view(len(segments), self.config.canvas_length, -1)
        shifted = torch.cat([rows[:, -1:], rows[:, :-1]], dim=1).view(canvas.shape)
        return shifted if index is None else hidden.index_copy(0, index, shifted)

    def _check(self, segments: list[int]) -> None:
        if any(n != self.config.canvas_length for n in segments):
            raise ValueError(
                f"the decoder adapter was trained for {self.config.canvas_length}-token "
                f"canvases; got DECODE rows of {sorted(set(segments))} tokens"
            )


def _lora_owners(model: DiffusionLM) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(module name, module, projection names) of every projection the adapter adapts: the
    attention and MLP blocks of the layers (never the self-conditioning block, which the
    adapter holds whole)."""
    owners: list[tuple[str, nn.Module, tuple[str, ...]]] = []
    for name, module in model.layers.named_modules(prefix="layers"):
        if isinstance(module, SelfConditioning):
            continue
        if isinstance(module, Attention):
            targets = tuple(t for t in ATTENTION_TARGETS if getattr(module, t) is not None)
            owners.append((name, module, targets))
        elif isinstance(module, GatedMLP):
            owners.append((name, module, MLP_TARGETS))
    return owners


def attach_adapter(model: DiffusionLM, config: AdapterConfig, seed: int = 0) -> DecoderAdapter:
    """Attach a fresh adapter (LoRA A random, B zero, position embeddings zero: a no-op until
    trained) to `model`, on its device and dtype, bound to its kernel set."""
    if config.canvas_length != model.config.canvas_length:
        raise ValueError(
            f"adapter canvas_length {config.canvas_length} differs from the model's "
            f"{model.config.canvas_length}"
        )
    weight = model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    for _, module, targets in _lora_owners(model):
        deltas = nn.ModuleDict()
        for target in targets:
            out_features, in_features = getattr(module, target).weight.shape
            delta = LoraDelta(in_features, out_features, config.rank, config.scale)
            with torch.no_grad():
                delta.lora_a.copy_(torch.randn(config.rank, in_features, generator=gen))
                delta.lora_a.mul_(in_features**-0.5)
            deltas[target] = delta
        module.lora = deltas.to(device=weight.device, dtype=weight.dtype)
    model.adapter = DecoderAdapter(config, model.cfg.hidden_size).to(weight.device, weight.dtype)
    model.bind_kernels(model.kernels)
    return model.adapter


def adapter_state(model: DiffusionLM) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(LoRA + position embeddings, self-conditioning block) tensors by their model names."""
    lora = {
        name: t
        for name, t in model.state_dict().items()
        if ".lora." in name or name.startswith("adapter.")
    }
    sc = {f"self_conditioning.{k}": v for k, v in model.self_conditioning.state_dict().items()}
    return lora, sc


def adapter_parameters(model: DiffusionLM) -> list[nn.Parameter]:
    """The trainable parameters of the attached adapter (frozen elsewhere), in a fixed order."""
    return [
        p
        for name, p in model.named_parameters()
        if ".lora." in name or name.startswith(("adapter.", "self_conditioning."))
    ]


def save_adapter(
    model: DiffusionLM, directory: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write the attached adapter into `directory` (created), in `dtype` (default: the
    model's; float16 halves a shipped adapter); returns it."""
    adapter = model.adapter
    if not isinstance(adapter, DecoderAdapter):
        raise ValueError("the model has no decoder adapter attached")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    lora, sc = adapter_state(model)
    for tensors, file in ((lora, LORA_FILE), (sc, SELF_CONDITIONING_FILE)):
        cpu = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in tensors.items()}
        save_file(cpu, str(out / file), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(asdict(adapter.config), indent=2) + "\n")
    return out


def read_adapter_config(directory: Path) -> AdapterConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: no {CONFIG_FILE} (not a decoder adapter directory)")
    try:
        return AdapterConfig(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a valid adapter config ({exc})") from None


def load_adapter(model: DiffusionLM, directory: str | Path) -> DecoderAdapter:
    """Attach the adapter saved in `directory` to `model`; every tensor must be there with the
    shape the model expects (a CheckpointError names the one that is not). Where the model's
    self-conditioning weights are FP8 (`--quantization fp8`), the adapter's replacements are
    quantized the same way (`quantize_fp8`), their scales made here."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    adapter = attach_adapter(model, config)
    lora, sc = adapter_state(model)
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    for names, file in ((lora, LORA_FILE), (sc, SELF_CONDITIONING_FILE)):
        path = directory / file
        if not path.is_file():
            raise CheckpointError(f"{directory}: adapter file {file} is missing")
        fp8 = {name for name, t in names.items() if t.dtype == FP8}
        made = {name + SCALE_SUFFIX for name in fp8}  # by quantize_fp8 below, not read
        names = {name: t for name, t in names.items() if name not in made}
        with safe_open(str(path), framework="pt") as handle:
            missing = sorted(set(names) - set(handle.keys()))
            if missing:
                raise CheckpointError(f"{path}: missing adapter tensor {missing[0]}")
            for name, current in names.items():
                tensor = handle.get_tensor(name)
                if tensor.shape != current.shape:
                    raise CheckpointError(
                        f"{path}: tensor {name} has shape {list(tensor.shape)}, expected "
                        f"{list(current.shape)}"
                    )
                if name in fp8:
                    weight, scale = quantize_fp8(tensor.to(device))
                    model.get_parameter(name).data = weight
                    model.get_parameter(name + SCALE_SUFFIX).data = scale
                    continue
                # Fresh memory (not the file's mapping, not the checkpoint's weights).
                model.get_parameter(name).data = tensor.to(device=device, dtype=dtype).clone()
    return adapter


ADAPTER_FILES = (CONFIG_FILE, LORA_FILE, SELF_CONDITIONING_FILE)


def install_adapter(source: Path, model_dir: Path) -> bool:
    """Make `source`'s adapter `model_dir`'s own (`model_dir/adapter/`, attached by default),
    replacing a different one whole; returns whether anything was copied (nothing when
    `source` holds no adapter)."""
    if not (source / CONFIG_FILE).is_file():
        return False
    target = model_dir / ADAPTER_SUBDIR
    if all(
        (target / f).is_file() and filecmp.cmp(source / f, target / f, shallow=False)
        for f in ADAPTER_FILES
    ):
        return False
    partial = model_dir / (ADAPTER_SUBDIR + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in ADAPTER_FILES:
        shutil.copy(source / f, partial / f)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)  # a model dir never holds half an adapter
    return True
