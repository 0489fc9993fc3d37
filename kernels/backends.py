"""Kernel backends by name. A backend is a small class: where it runs, the module of kernels
it starts from (named as their twins in `kernels.reference`) and what it changes per numerics.
`TwinsBackend` is the base (of the `Backend` protocol); `NativeBackend` and `TritonBackend`
change only what differs. On
top of every backend the same exact-numerics override applies (`EXACT`), and
`KernelSet.with_custom_ops` wraps any fast set as custom ops. A new backend is one class and
one `register` call."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, TypeVar

import kernels.reference as reference
import kernels.support as support
from kernels.kernel_set import FP8_ROWS, KERNELS, OPTIONAL, KernelSet

# Each module exports KERNELS: its launchers, named exactly as their twins in `reference`.
TRITON_MODULES = (
    "kernels.triton_attention",
    "kernels.triton_fp8",
    "kernels.triton_fp8_emit",
    "kernels.triton_fp8_moe",
    "kernels.triton_layer",
    "kernels.triton_moe",
    "kernels.triton_norm",
    "kernels.triton_sampler",
)
# Exact numerics on every backend: the reference's per-request order for the norm tails and
# the projections (a request's values never depend on its batch). The router, experts and
# attention come from the backend (batch invariant by construction, or overridden by it).
EXACT: dict[str, Callable[..., Any]] = {
    "rms_norm": reference.rms_norm,
    "add_rms_norm": reference.add_rms_norm_exact,
    "rms_norm_pair": reference.rms_norm_pair_exact,
    "close_layer": reference.close_layer_exact,
    "gated_act": reference.gated_act,
    "qkv_norm_rope": reference.qkv_norm_rope_exact,
    "softcap": reference.softcap,
    "linear": reference.segment_linear,
}
# The kernels every backend's module names; the optional ones (None: composed) are not.
REQUIRED = tuple(name for name in KERNELS if name not in OPTIONAL)


def batched(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` over all tokens of a step at once: the per-request `segments` are dropped."""

    @functools.wraps(fn)
    def call(*args: Any, segments: list[int] | None = None) -> Any:
        return fn(*args)

    return call


class Backend(Protocol):
    """What `resolve_kernels` asks of a registered backend."""

    name: str

    def refusal(self, device_type: str, exact: bool) -> str | None: ...

    def auto(self, device_type: str, exact: bool) -> bool: ...

    def kernels(self, exact: bool) -> KernelSet: ...


class TwinsBackend:
    """The PyTorch twins (`kernels.reference`), on every device: the base of every backend."""

    name = "twins"

    def refusal(self, device_type: str, exact: bool) -> str | None:
        """Why this backend cannot run on `device_type` in these numerics; None: it can."""
        return None

    def auto(self, device_type: str, exact: bool) -> bool:
        """Whether `auto` may pick this backend (in `AUTO`'s order) where it can run."""
        return self.refusal(device_type, exact) is None

    def ops(self) -> Any:
        """The module (or namespace) of kernels, each named as its twin in `reference`."""
        return reference

    def fast(self, ops: Any) -> dict[str, Callable[..., Any]]:
        """Fast numerics' kernels where they differ from `ops`' of the same name."""
        return {
            "rms_norm": reference.rms_norm_fused,  # one row's passes, batch invariant
            "linear": reference.linear,
            "route_experts": batched(ops.route_experts),
            "fused_moe": reference.fused_moe_scattered,  # the twins' scattered combine
        }

    def exact(self, ops: Any) -> dict[str, Callable[..., Any]]:
        """Exact numerics' kernels beyond `EXACT` where they differ from `ops`'."""
        return {"canvas_attention": reference.canvas_attention_rowwise}

    def prepare(self) -> Callable[[KernelSet], KernelSet] | None:
        """What turns a fast set into one model's (`KernelSet.for_model`, once per model at
        bind: the backend's per-model state); None: the set as it is."""
        return None

    def kernels(self, exact: bool) -> KernelSet:
        """The set: `ops`' kernels, then fast numerics' changes or the exact override."""
        ops = self.ops()
        chosen = {name: getattr(ops, name) for name in REQUIRED}
        chosen |= (EXACT | self.exact(ops)) if exact else self.fast(ops)
        prepare = None if exact else self.prepare()
        return KernelSet(backend=self.name, exact=exact, prepare=prepare, **chosen)


class NativeBackend(TwinsBackend):
    """The twins plus the C kernels (`kernels.native`) on the CPU, in fast numerics: the
    sampler, norms, router, experts, dense projections and attention (the projections and
    experts in fp32 and bf16: `kernels.native.bf16`); each falls back to its twin per call
    where its operands do not fit (other dtypes, autograd, odd shapes)."""

    name = "native"

    def refusal(self, device_type: str, exact: bool) -> str | None:
        from kernels.native import build

        if device_type != "cpu":
            return "runs on the CPU only"
        if exact:
            return "carries fast numerics only (exact numerics: --kernels twins)"
        if not build.available():
            return "needs the C kernels, which do not build here (or CANVAS_NATIVE=0)"
        return None

    def fast(self, ops: Any) -> dict[str, Callable[..., Any]]:
        from kernels.native import attention, moe, norms, sampler, step

        return super().fast(ops) | {
            "rms_norm": norms.rms_norm,
            "add_rms_norm": norms.add_rms_norm,
            "rms_norm_pair": norms.rms_norm_pair,
            "close_layer": norms.close_layer,
            "qkv_norm_rope": step.qkv_norm_rope,
            "route_experts": step.route_experts,
            "gated_act": step.gated_act,
            "fused_moe": moe.fused_moe,
            "linear": moe.linear,
            "gated_linear": moe.gated_linear,
            "linear_many": moe.linear_many,
            "canvas_attention": attention.canvas_attention,
            "fused_sample": sampler.fused_sample,
            "sample_and_embed": sampler.sample_and_embed,
            "philox_uniform": step.philox_uniform,
        }

    def prepare(self) -> Callable[[KernelSet], KernelSet] | None:
        from kernels.native import bind_packed

        return bind_packed


class TritonBackend(TwinsBackend):
    """The Triton kernels (CUDA; on CPU only under TRITON_INTERPRET=1: tests), the twins where
    none exists."""

    name = "triton"

    def refusal(self, device_type: str, exact: bool) -> str | None:
        if not support.triton_available():
            return "needs the triton package (pip install triton)"
        return None

    def auto(self, device_type: str, exact: bool) -> bool:
        return device_type == "cuda" and super().auto(device_type, exact)

    def ops(self) -> Any:
        return triton_ops()

    def fast(self, ops: Any) -> dict[str, Callable[..., Any]]:
        # Triton's norm is one pass; its experts kernels (FP8's too) are batched already. FP8
        # projections take `_scaled_mm` where the device has it, with the FP8 rows the norms
        # emit and FP8 x FP8 experts; FP8 experts elsewhere Triton's E4M3 kernel where it
        # compiles; elsewhere (sm_80) each dequantizes, as its twin does.
        fp8 = importlib.import_module("kernels.triton_fp8")
        e4m3, scaled = fp8.e4m3_kernels(), fp8.scaled_mm_rowwise()
        return super().fast(ops) | {
            "rms_norm": ops.rms_norm,
            "fused_moe": ops.fused_moe,
            "fp8_linear": ops.fp8_linear if scaled else reference.fp8_linear,
            "fp8_moe": ops.fp8_moe if e4m3 else reference.fp8_moe_with(ops.fused_moe),
            **{name: getattr(ops, name) for name in FP8_ROWS if scaled},
        }

    def exact(self, ops: Any) -> dict[str, Callable[..., Any]]:
        return {}  # Triton's router, experts and attention are batch invariant by construction


REGISTRY: dict[str, Backend] = {}
B = TypeVar("B", bound=Backend)


def register(backend: B) -> B:
    """Add `backend` under its name (`resolve_kernels(..., backend.name)` then binds it)."""
    REGISTRY[backend.name] = backend
    return backend


register(TwinsBackend())
register(NativeBackend())
register(TritonBackend())
# What `auto` tries, first that can run: Triton on CUDA, the C kernels on the CPU, the twins.
AUTO = ("triton", "native", "twins")
# The names users choose from (`--kernels`), "auto" first.
BACKENDS = ("auto", *REGISTRY)


def resolve_kernels(device_type: str, backend: str = "auto", exact: bool = False) -> KernelSet:
    """The kernel set for a device type ("cpu", "cuda") and numerics. backend "auto": Triton
    on CUDA when triton is installed; on the CPU in fast numerics the native C kernels where
    this machine builds them (`kernels.native`); the twins otherwise. Any other name is a
    registered backend's (`REGISTRY`); ValueError where it is unknown or cannot run here."""
    if backend == "auto":
        backend = next(n for n in AUTO if REGISTRY[n].auto(device_type, exact))
    chosen = REGISTRY.get(backend)
    if chosen is None:
        names = ", ".join(("auto", *REGISTRY))
        raise ValueError(f"kernel backend must be one of {names}, got {backend!r}")
    refusal = chosen.refusal(device_type, exact)
    if refusal is not None:
        raise ValueError(f"kernel backend {backend!r} {refusal}")
    return chosen.kernels(exact)


@functools.cache
def triton_ops() -> ModuleType:
    """The Triton implementations (twins where none exists), whatever the device: CUDA engines
    bind them; tests and the benchmark's dry run use them under TRITON_INTERPRET=1 on CPU."""
    module = ModuleType("kernels.triton_ops", "Triton kernels, twins where none exists.")
    public = {k: v for k, v in vars(reference).items() if not k.startswith("_")}
    module.__dict__.update(public)
    for name in TRITON_MODULES:
        for launcher in importlib.import_module(name).KERNELS:
            assert launcher.__name__ in public, f"{name}.{launcher.__name__} has no twin"
            setattr(module, launcher.__name__, launcher)
    return module
