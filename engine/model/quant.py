"""FP8 weights: the checkpoint layout Canvas reads and writes, its quantizer, and the rewrite
that gives a model's projections FP8 storage.

The layout is compressed-tensors' per-channel FP8 ("FP8-dynamic", what vLLM's FP8 checkpoints
hold): config.json's `quantization_config` has quant_method "compressed-tensors", format
"float-quantized", config groups whose `weights` are {num_bits 8, type float, strategy
channel, symmetric, dynamic false} and whose `input_activations`, if any, are {num_bits 8,
type float, strategy token, dynamic true} (scaled per token at run time, so no `input_scale`
tensors), no `kv_cache_scheme` or `sparsity_config`, and an `ignore` list of module names or
"re:<regex>" kept unquantized. A quantized parameter `<name>` is stored as F8_E4M3 beside
`<name>_scale` [..., out, 1] (fp32, bf16 or fp16): `q_proj.weight` and `q_proj.weight_scale`;
the fused experts' `experts.gate_up_proj` and `experts.gate_up_proj_scale`, a scale per expert
and output channel. Experts stored one tensor per expert and projection (llm-compressor's
`experts.<e>.gate_proj.weight` and `weight_scale`, `up_proj`, `down_proj`) are read as those
fused tensors (`engine.model.per_expert`). Its value is fp8 * scale.

What may be FP8 in Canvas is what a module lists in its `FP8_PARAMS`: attention's and the dense
MLPs' projections, the experts. The embedding (and tied head), router, norms and vision tower
keep their dtype.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model.config import CheckpointError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale"
SAFETENSORS_FP8 = "F8_E4M3"
QUANTIZATION_CHOICES = ("auto", "fp8")  # --quantization: the checkpoint's own, or FP8 at load
# What Canvas writes (`canvas convert --quantization fp8`) and reads.
QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
WEIGHTS |= {"dynamic": False}
INPUT_ACTIVATIONS = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
# The modules a converted checkpoint keeps unquantized, in compressed-tensors' spelling.
IGNORE = ("lm_head", "re:.*embed.*", "re:.*router.*", "re:.*vision.*")


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    """A checkpoint's FP8 layout: `ignore`, the modules it keeps unquantized."""

    ignore: tuple[str, ...] = IGNORE

    def ignores(self, module: str) -> bool:
        """Whether checkpoint module `module` (a key without `.weight`) is on the ignore list."""
        for target in self.ignore:
            if target.startswith("re:"):
                if re.match(target[3:], module):
                    return True
            elif target == module:
                return True
        return False

    def as_config(self) -> dict[str, Any]:
        """config.json's `quantization_config` for this layout."""
        group = {
            "targets": ["Linear"],
            "weights": dict(WEIGHTS),
            "input_activations": dict(INPUT_ACTIVATIONS),
            "output_activations": None,
        }
        return {
            "quant_method": QUANT_METHOD,
            "format": FORMAT,
            "config_groups": {"group_0": group},
            "ignore": list(self.ignore),
            "kv_cache_scheme": None,
        }


def read_layout(model_dir: str | Path) -> Fp8Layout | None:
    """The FP8 layout of `model_dir/config.json`'s `quantization_config`; None without one.
    CheckpointError naming the key and value for any layout Canvas does not read."""
    raw = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    return None if raw is None else parse_layout(raw)


def parse_layout(raw: Any) -> Fp8Layout:
    """`quantization_config` as an `Fp8Layout` (see the module docstring for what is read)."""
    where = "config.json quantization_config"
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(
            f"{where}.quant_method {method!r} is not supported: Canvas reads compressed-tensors' "
            f"per-channel FP8 layout (quant_method {QUANT_METHOD!r}, format {FORMAT!r})"
        )
    _expect(f"{where}.format", raw.get("format"), FORMAT)
    if raw.get("kv_cache_scheme") is not None:
        raise CheckpointError(f"{where}.kv_cache_scheme: FP8 KV cache scales are not supported")
    if raw.get("sparsity_config"):
        raise CheckpointError(f"{where}.sparsity_config: sparse weights are not supported")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}.config_groups must be a non-empty object")
    for name, group in groups.items():
        _check_group(f"{where}.config_groups.{name}", group)
    ignore = raw.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(t, str) for t in ignore):
        raise CheckpointError(f"{where}.ignore must be a list of module names, got {ignore!r}")
    for target in ignore:
        if target.startswith("re:"):
            try:
                re.compile(target[3:])
            except re.error as exc:
                raise CheckpointError(
                    f"{where}.ignore: {target!r} is not a regex ({exc})"
                ) from None
    return Fp8Layout(tuple(ignore))


def _check_group(where: str, group: Any) -> None:
    if not isinstance(group, dict):
        raise CheckpointError(f"{where} must be an object")
    if group.get("format") is not None:
        _expect(f"{where}.format", group["format"], FORMAT)
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise CheckpointError(f"{where}.weights must be an object")
    for key, want in WEIGHTS.items():
        _expect(f"{where}.weights.{key}", weights.get(key), want)
    activations = group.get("input_activations")
    if activations is not None:
        if not isinstance(activations, dict):
            raise CheckpointError(f"{where}.input_activations must be an object or null")
        if activations.get("dynamic") is not True:
            raise CheckpointError(
                f"{where}.input_activations: static activation scales (dynamic "
                f"{activations.get('dynamic')!r}) are not supported; only dynamic per-token"
            )
        for key, want in INPUT_ACTIVATIONS.items():
            _expect(f"{where}.input_activations.{key}", activations.get(key), want)
    if group.get("output_activations") is not None:
        raise CheckpointError(f"{where}.output_activations: output quantization is not supported")


def _expect(where: str, value: Any, want: Any) -> None:
    if value != want:
        raise CheckpointError(
            f"{where} {value!r} is not supported (Canvas reads {want!r}: per-channel FP8 E4M3 "
            "weights, dynamic per-token activations)"
        )


def refuse_exact(exact: bool, fp8: str | None) -> None:
    """ValueError naming both flags when exact numerics are asked of FP8 weights (`fp8` says
    where they come from: "--quantization fp8", "an FP8 checkpoint"; None: none)."""
    if exact and fp8 is not None:
        raise ValueError(
            f"--exact cannot run {fp8}: exact numerics are the reference's on unquantized "
            "weights; drop --exact or --quantization fp8 (or load an unquantized checkpoint)"
        )


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 of weight [..., out, in], on its device: (float8_e4m3fn of its
    shape, fp32 scale [..., out, 1]) with scale = amax over `in` / 448 and fp8 = weight / scale
    rounded to nearest. Its working memory is one fp32 copy of `weight`."""
    work = weight.to(torch.float32, copy=True)
    scale = work.abs().amax(dim=-1, keepdim=True).div_(FP8_MAX)
    scale.clamp_(min=torch.finfo(torch.float32).tiny)  # an all-zero row keeps zeros
    return work.div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_candidates(model: nn.Module) -> dict[str, list[str]]:
    """The parameters of `model` that may be FP8 (each module's `FP8_PARAMS`), by module: a
    module's are FP8 together or not at all (its kernels take one kind of weight)."""
    params = dict(model.named_parameters())
    groups = {}
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{p}" if prefix else p for p in getattr(module, "FP8_PARAMS", ())]
        names = [name for name in names if name in params]  # a layer without v_proj has none
        if names:
            groups[prefix] = names
    return groups


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def make_fp8(model: nn.Module, names: Iterable[str]) -> None:
    """Give each parameter of `names` FP8 storage and a `<name>_scale` [..., out, 1] fp32
    parameter beside it, both empty on the parameter's device (the meta device before a load
    assigns them)."""
    for name in names:
        module, leaf = _owner(model, name)
        param = module._parameters[leaf]
        assert param is not None, name
        shape, device = param.shape, param.device
        module._parameters[leaf] = nn.Parameter(
            torch.empty(shape, dtype=FP8, device=device), requires_grad=False
        )
        scale = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device)
        module.register_parameter(leaf + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))


def scale_of(module: nn.Module, param: str) -> torch.Tensor | None:
    """The scale of `module`'s parameter `param` when it is FP8; None when it is not."""
    return module._parameters.get(param + SCALE_SUFFIX)


@dataclass(frozen=True, slots=True)
class Fp8Choice:
    """Which parameters load as FP8: `stored` as FP8 in the checkpoint (with their scales),
    `quantized` at load from its floating-point tensors (`--quantization fp8`)."""

    stored: frozenset[str] = frozenset()
    quantized: frozenset[str] = frozenset()

    @property
    def scales(self) -> frozenset[str]:
        """The scales of `stored`, read from the checkpoint."""
        return frozenset(name + SCALE_SUFFIX for name in self.stored)

    @property
    def made_scales(self) -> frozenset[str]:
        """The scales the load makes (of `quantized`): no checkpoint tensor holds them."""
        return frozenset(name + SCALE_SUFFIX for name in self.quantized)

    def load(
        self, name: str, tensor: torch.Tensor, device: str, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """Parameter `name` (and its scale, when quantized here) from checkpoint `tensor`:
        FP8 as stored, scales in fp32, quantized on `device`, anything else cast to `dtype`."""
        if name in self.quantized:
            weight, scale = quantize_fp8(tensor.to(device))
            return {name: weight, name + SCALE_SUFFIX: scale}
        if name in self.stored:
            return {name: tensor.to(device)}
        if name in self.scales:
            return {name: tensor.to(device=device, dtype=torch.float32)}
        return {name: tensor.to(device=device, dtype=dtype)}


def choose_fp8(
    model: nn.Module,
    stored: Callable[[str], tuple[str, str] | None],
    layout: Fp8Layout | None,
    quantization: str,
) -> Fp8Choice:
    """Which of `model`'s parameters load as FP8. `stored(name)`: the checkpoint key and
    safetensors dtype of parameter `name` (None: absent). With a `layout` the checkpoint's
    F8_E4M3 tensors are FP8 (whatever `quantization` says); without one, `quantization` "fp8"
    quantizes every candidate at load. CheckpointError for an FP8 tensor of a module that
    `layout` ignores."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    groups = fp8_candidates(model)
    if layout is None:
        every = [name for names in groups.values() for name in names]
        return Fp8Choice(quantized=frozenset(every if quantization == "fp8" else ()))
    fp8: set[str] = set()
    for names in groups.values():
        found = [stored(name) for name in names]
        keys = {f[0] for f in found if f is not None and f[1] == SAFETENSORS_FP8}
        if keys and len(keys) < len(names):
            raise CheckpointError(
                f"tensors {sorted(keys)} are {SAFETENSORS_FP8} but not all of "
                f"{names}: Canvas reads a module's projections all FP8 or none"
            )
        for key in keys:
            module = key.removesuffix(".weight")
            if layout.ignores(module):
                raise CheckpointError(
                    f"tensor {key} is {SAFETENSORS_FP8} but quantization_config.ignore lists "
                    f"{module}"
                )
        fp8.update(names if keys else ())
    return Fp8Choice(stored=frozenset(fp8))
