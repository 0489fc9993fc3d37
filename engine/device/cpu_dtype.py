"""`--dtype auto` on the CPU: bf16 or fp32, whichever runs the checkpoint faster on this CPU.

Decided from the CPU's features, not measured at start-up as the thread count is: a measurement
would load the weights in both dtypes (twice the memory of the larger, seconds of a start-up
that takes a few) and on a shared VM one forward's timing swings by more than the margin that
decides. The features predict the outcome well enough:

- with AMX-bf16 (`amx_bf16`, and oneDNN not capped below AMX by ONEDNN_MAX_CPU_ISA) the dense
  bf16 projections run on oneDNN's AMX tiles and the experts on `kernels/native/bf16_amx.h`'s,
  and a bf16 forward beats fp32's at one canvas and at many;
- without it (AVX512-BF16's `vdpbf16ps` only, or the generic vector code) the bf16 tiles run no
  faster than the fp32 FMA tiles and the conversions cost on top: fp32 runs faster at one
  canvas and at many (docs/performance.md, "bf16 on the CPU", has the measurements).

So, for a checkpoint that `auto` would otherwise load as stored (`choose_cpu_dtype`):

- stored in bf16: bf16 with AMX-bf16; fp32 without it (bf16 widens to fp32 exactly), unless
  its weights in fp32 would not fit in half the available memory (then bf16 as stored);
- stored in fp32: bf16 with AMX-bf16 when every weight is exactly a bf16 value (a checkpoint
  widened from bf16: rounding to bf16 changes no weight), fp32 otherwise (rounding would
  change the model; `--dtype bfloat16` still asks for it);
- stored in fp16: as stored (`auto` chooses between the two dtypes the native CPU kernels run).

A GPU, `--exact` (token-identical to the reference in the checkpoint's dtype) and FP8 keep the
loader's `auto`, the checkpoint's dtype; `--dtype` other than auto forces one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.device.memory import available_ram
from engine.model import load_model_config
from engine.model.loader import resolve_device, weight_files
from engine.model.quant import read_layout
from kernels.native.build import cpu_flags

logger = logging.getLogger(__name__)
# Elements of one F32 tensor checked at a time for bf16 values (bounds the temporary).
SCAN_CHUNK = 1 << 24
# bf16 widened to fp32 when fp32's weights take at most this share of the available memory.
FP32_MEMORY_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype `auto` chose (a `engine.model.loader.DTYPES` name) and why, in a few words."""

    dtype: str
    reason: str

    def describe(self) -> str:
        return f"dtype {self.dtype} (--dtype auto): {self.reason}"


def has_amx_bf16(flags: frozenset[str], onednn_isa: str) -> bool:
    """Whether bf16 GEMMs run on AMX tiles: the CPU has `amx_bf16` and `onednn_isa` (the value
    of ONEDNN_MAX_CPU_ISA, "" unset) does not cap oneDNN below AMX."""
    isa = onednn_isa.upper()
    return "amx_bf16" in flags and (isa in ("", "ALL", "DEFAULT") or "AMX" in isa)


def choose_cpu_dtype(
    stored: str,
    flags: frozenset[str],
    onednn_isa: str,
    bf16_exact: Callable[[], bool],
    fp32_fits: Callable[[], bool],
) -> DtypeChoice:
    """The dtype a checkpoint stored in `stored` runs fastest in on a CPU with feature `flags`
    (the module docstring has the rules). `bf16_exact()`: every weight is a bf16 value;
    `fp32_fits()`: the weights in fp32 fit; each is called only where it decides."""
    amx = has_amx_bf16(flags, onednn_isa)
    if stored == "bfloat16":
        if amx:
            return DtypeChoice("bfloat16", "the checkpoint's, and this CPU has AMX-bf16")
        if not fp32_fits():
            return DtypeChoice(
                "bfloat16", "the checkpoint's: no AMX-bf16 here, but fp32 weights would not fit"
            )
        return DtypeChoice(
            "float32", "this CPU has no AMX-bf16, where fp32 runs faster (bf16 widens exactly)"
        )
    if stored != "float32":
        return DtypeChoice(stored, "the checkpoint's (auto chooses between bf16 and fp32 only)")
    if not amx:
        return DtypeChoice("float32", "the checkpoint's, and this CPU has no AMX-bf16")
    if bf16_exact():
        return DtypeChoice(
            "bfloat16", "this CPU has AMX-bf16 and every fp32 weight is exactly a bf16 value"
        )
    return DtypeChoice(
        "float32", "the checkpoint's: its weights are not all bf16 values (bf16 would round them)"
    )


def all_bf16_values(files: Sequence[Path]) -> bool:
    """Whether every F32 tensor of the safetensors `files` holds only bf16 values (the low 16
    bits of each word zero), so that rounding to bf16 changes none. Stops at the first value
    that is not one."""
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if f.get_slice(key).get_dtype() != "F32":
                    continue
                words = f.get_tensor(key).reshape(-1).view(torch.int32)
                if any(bool((chunk & 0xFFFF).any()) for chunk in words.split(SCAN_CHUNK)):
                    return False
    return True


def fp32_fits(files: Sequence[Path], stored_itemsize: int) -> bool:
    """Whether the weights of `files` (stored `stored_itemsize` bytes per value) in fp32 take
    at most FP32_MEMORY_SHARE of the available memory."""
    stored = sum(path.stat().st_size for path in files)
    return stored * 4 / stored_itemsize <= FP32_MEMORY_SHARE * available_ram()


def auto_dtype(model_dir: Path, dtype: str, device: str, exact: bool, quantization: str) -> str:
    """The dtype to load `model_dir` in: `dtype` itself unless it is `auto` on the CPU for a
    fast (not `exact`), unquantized model, where `choose_cpu_dtype` decides from this CPU's
    features (its choice and reason logged)."""
    if dtype != "auto" or exact or quantization != "auto" or resolve_device(device) != "cpu":
        return dtype
    stored = load_model_config(model_dir).dtype or "float32"
    if read_layout(model_dir) is not None:  # FP8: its own rules (`engine.model.quant`)
        return dtype
    files = weight_files(model_dir)
    itemsize = 2 if stored in ("bfloat16", "float16") else 4
    from safetensors import SafetensorError

    try:
        choice = choose_cpu_dtype(
            stored,
            cpu_flags(),
            os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            lambda: all_bf16_values(files),
            lambda: fp32_fits(files, itemsize),
        )
    except SafetensorError:  # an unreadable file: the loader names it
        return dtype
    logger.info("%s", choice.describe())
    return choice.dtype
