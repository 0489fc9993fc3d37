"""An op accountant: a `TorchDispatchMode` that records every op a step runs, with its FLOPs,
bytes moved, kernel launches and host synchronisations, and predicts its time on a device from
peak rates (`Hardware`): max(FLOPs / peak, bytes / bandwidth) + a per-launch cost.

- FLOPs: `torch.utils.flop_counter`'s formulas (matmuls, convolutions, attention); the custom
  ops (`canvas::*`) have their own rules (`loadtest.gpu.custom_rules`), which model the
  Triton kernels that CUDA runs.
- Bytes: the sizes of an op's tensor inputs and outputs; views and allocations move nothing;
  gathers read their output's worth of rows, in-place scatters read and write their values.
- Syncs: ops whose output shape or value the host needs (`.item()`, `nonzero`, `bincount`,
  boolean masks, `repeat_interleave` without `output_size`) and blocking copies between the
  host and the device. On the meta device they cannot run: the accountant records them and
  returns a stand-in (an upper-bound shape, a zero), so the step runs on.
- Ops on host tensors (the inputs a step builds on the CPU) are host work, not kernels.
- Host-to-device copies by source memory: pinned when the source was staged by
  `engine.device.cuda` (a `host_buffer`, pinned on CUDA, or what `to_device` moves, which CUDA
  stages in one: told through `STAGING_OBSERVERS`), pageable otherwise (a tensor made from a
  list or a numpy array and moved with `.to`, `torch.tensor(..., device=)`). On the meta device
  nothing is pinned: the accountant counts what CUDA would do. A copy from pageable memory may
  wait for the stream (CUDA stages it through a pinned buffer of its own).

`phase(name)` labels what follows (inputs, forward, sampler, publish) for the sync checks;
`graph()` marks what follows as a CUDA graph's replay (`MetaCapture`): one launch for the
graph, none for the kernels it holds (their bytes and FLOPs count as ever).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from engine.device import cuda as device_cuda
from loadtest.gpu.call_sites import in_prepare, project_frame
from loadtest.gpu.custom_rules import CUSTOM_RULES, nbytes, tensors_of

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Hardware:
    """Peak rates of one device. `launch_s`: each kernel launch's fixed cost; `sync_s`: each
    host synchronisation's (a round trip that drains the queue)."""

    name: str
    tensor_flops: float  # dense bf16/fp16 matmul FLOP/s
    fp32_flops: float  # fp32 matmul FLOP/s
    bandwidth: float  # memory B/s
    launch_s: float
    sync_s: float
    # attention's FLOP/s where it is measured apart from the matmuls (a CPU's SDPA runs far
    # below its GEMM rate); 0: the matmul rate
    attention_flops: float = 0.0

    def with_launch(self, launch_s: float) -> Hardware:
        """This device with a measured launch cost (`loadtest.gpu.launch_probe`)."""
        return replace(self, launch_s=launch_s)


# Datasheet dense peaks (no sparsity); fp32 matmuls run in IEEE fp32 (TF32 is off by default).
H100 = Hardware("H100 SXM", 989e12, 67e12, 3.35e12, 4e-6, 20e-6)
H200 = Hardware("H200", 989e12, 67e12, 4.8e12, 4e-6, 20e-6)
GPUS = (H200, H100)

GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution, aten._grouped_mm}
_ALLOCATIONS = {
    aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
    aten.detach, aten.detach_, aten.alias, aten._local_scalar_dense,
}  # fmt: skip
_GATHERS = {aten.embedding, aten.index, aten.index_select, aten.gather}
_SCATTERS_IN_PLACE = {aten.index_put_, aten.index_copy_, aten.index_add_, aten.scatter_}
# Ops whose output's shape (or value) the host must know: a device-to-host round trip.
_SHAPE_SYNCS = {
    aten.nonzero, aten.masked_select, aten.bincount, aten.unique_consecutive, aten._unique2,
    aten.unique_dim,
}  # fmt: skip
_COPIES = {aten._to_copy, aten.copy_, aten.to}
# Attention as the CPU runs it: the composite op (seen whole) and its CPU kernel.
_SDPA_CPU = {aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu}


@dataclass(slots=True)
class OpRecord:
    """One op of a step. `gemm`: counts towards the step's GEMM FLOPs; `fp32`: a GEMM in fp32;
    `host`: ran on host tensors (no kernel); `sync`: the kind of host synchronisation, if any;
    `copy`: "pinned" or "pageable" for a host-to-device copy (its source memory on CUDA);
    `host_bytes`: the host memory it reads (a host op's inputs and outputs, a copy's source)."""

    name: str
    phase: str
    flops: float = 0.0
    bytes: float = 0.0
    launches: int = 1
    gemm: bool = False
    fp32: bool = False
    attention: bool = False  # an attention kernel (SDPA, canvas attention): its own rate
    host: bool = False
    sync: str = ""
    where: str = ""
    wall_s: float = 0.0  # the op's own run time here (meaningful on a real device only)
    copy: str = ""
    host_bytes: float = 0.0
    captured: bool = False  # ran in a replayed CUDA graph: launched by the graph, not the host

    @property
    def host_launches(self) -> int:
        """The launches the host makes for this op (none for a kernel of a graph)."""
        return 0 if self.host or self.captured else self.launches

    def seconds(self, hw: Hardware) -> float:
        if self.host:
            return 0.0
        rate = hw.fp32_flops if self.fp32 else hw.tensor_flops
        if self.attention and hw.attention_flops:
            rate = hw.attention_flops
        time = max(self.flops / rate, self.bytes / hw.bandwidth) + self.host_launches * hw.launch_s
        return time + (hw.sync_s if self.sync else 0.0)


@dataclass(slots=True)
class StepRows:
    """The rows of the step being accounted (start, new tokens, DECODE?), which the attention
    rules need: a meta tensor holds no per-row values."""

    rows: list[tuple[int, int, bool]] = field(default_factory=list)


def sdpa_flops(q: torch.Tensor, k: torch.Tensor) -> float:
    """An attention call's FLOPs: q [..., H, T, D] against k [..., Hkv, S, D] (grouped heads
    share keys): Q·Kᵀ and P·V, 2 FLOPs per multiply-add each, masked entries included (as
    `torch.utils.flop_counter` counts the GPU kernels)."""
    batch = q.numel() // (q.shape[-1] * q.shape[-2])  # every query head of every row
    return 4.0 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1]


class Accountant(TorchDispatchMode):
    """Records the ops run under it (see the module docstring). `device_type`: where the
    step's kernels run ("meta" for a prediction, "cpu" for a calibration run); ops on other
    devices are host work."""

    def __init__(self, device_type: str = "meta", rows: StepRows | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.rows = rows or StepRows()
        self.records: list[OpRecord] = []
        self.current = "step"
        self.replaying = False  # inside `graph()`
        # Host memory staged for copies while active (module docstring): the storages are
        # held, so that no pageable tensor made later can take a staged one's address.
        self._staged: list[torch.UntypedStorage] = []
        self._staged_ptrs: set[int] = set()

    def _observe(self, staged: torch.Tensor) -> None:
        storage = staged.untyped_storage()
        self._staged.append(storage)
        self._staged_ptrs.add(storage.data_ptr())

    def pinned(self, host: torch.Tensor) -> bool:
        """Whether a copy from `host` would read pinned memory on CUDA (module docstring)."""
        return host.untyped_storage().data_ptr() in self._staged_ptrs

    def __enter__(self) -> Accountant:
        # `torch.tensor(data, device=...)` copies without reaching the dispatcher (on CUDA a
        # blocking copy): seen here, at the Python call.
        self._tensor = make = torch.tensor

        def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = make(data, *args, **kwargs)
            if out.device.type == self.device_type != "cpu":
                self.sync("tensor", "blocking host to device copy", nbytes([out]))
                self.records[-1].copy, self.records[-1].host_bytes = "pageable", nbytes([out])
            return out

        torch.tensor = tensor  # type: ignore[assignment]
        device_cuda.STAGING_OBSERVERS.append(self._observe)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        torch.tensor = self._tensor  # type: ignore[assignment]
        device_cuda.STAGING_OBSERVERS.remove(self._observe)
        super().__exit__(*exc)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    @contextmanager
    def graph(self) -> Iterator[None]:
        """What runs inside is a CUDA graph's replay: one launch (the graph's, recorded here)."""
        self.records.append(OpRecord("graph.replay", self.current))
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    def sync(self, name: str, kind: str, size: float = 0.0) -> None:
        """Record a synchronisation seen outside the dispatcher (e.g. `.tolist()` on meta)."""
        phase = "inputs" if self.current == "forward" and in_prepare() else self.current
        record = OpRecord(name, phase, bytes=size, sync=kind, where=project_frame())
        record.captured = self.replaying
        self.records.append(record)

    # -- dispatch -----------------------------------------------------------------------------

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = tensors_of(args, kwargs)
        on_device = any(t.device.type == self.device_type for t in tensors) or (
            str(kwargs.get("device", "")).startswith(self.device_type)
        )
        sync = self._sync_kind(func, args, kwargs, tensors) if on_device else ""
        meta = self.device_type == "meta"
        out = _stand_in(func, args, kwargs) if sync and meta else None
        began = time.perf_counter()
        if out is None:
            out = func(*args, **kwargs)
        elapsed = time.perf_counter() - began
        packet = func.overloadpacket
        if func.namespace == "canvas":
            for custom in custom_records(self, func, args, out):
                custom.captured = self.replaying
                self.records.append(custom)
            return out
        record = OpRecord(str(packet).replace("aten.", ""), self.current, sync=sync)
        record.captured = self.replaying
        record.wall_s = elapsed
        record.host = not on_device
        if func.is_view or packet in _ALLOCATIONS:
            record.launches = 0
        else:
            record.bytes = _op_bytes(packet, args, out, tensors)
        if packet in (aten.linear, aten.matmul):  # seen whole here: 2 * rows * in * out
            out_dim = tensors[1].shape[0] if packet is aten.linear else tensors[1].shape[-1]
            record.flops = 2.0 * tensors[0].numel() * out_dim
            record.gemm, record.fp32 = True, tensors[0].dtype == torch.float32
        elif packet in _SDPA_CPU:  # CPU attention, which the registry does not know
            record.flops, record.attention = sdpa_flops(tensors[0], tensors[1]), True
        elif packet is aten._grouped_mm:  # x [M, K] by w [E, K, N], each row by one expert
            record.flops = 2.0 * tensors[0].shape[0] * tensors[0].shape[1] * tensors[1].shape[-1]
            record.gemm, record.fp32 = True, tensors[0].dtype == torch.float32
        elif packet in flop_registry:
            record.flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            record.gemm = packet in GEMMS
            record.fp32 = record.gemm and tensors[0].dtype == torch.float32
            record.attention = "scaled_dot_product" in str(packet)
        source = self._host_source(func, args, kwargs) if on_device else None
        if source is not None:
            record.copy = "pinned" if self.pinned(source) else "pageable"
            record.host_bytes = nbytes([source])
        elif record.host:
            record.host_bytes = record.bytes
        if sync or source is not None:
            record.where = project_frame()
        if self.current == "forward" and (
            (sync and in_prepare()) or (record.host_bytes and in_prepare(runner_calls=True))
        ):
            record.phase = "inputs"
        self.records.append(record)
        return out

    def _host_source(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> torch.Tensor | None:
        """The host tensor a copy to the step's device reads, or None (not such a copy)."""
        if func.overloadpacket not in _COPIES or self.device_type == "cpu":
            return None
        named = _named(func, args, kwargs)
        src = named.get("src", named.get("self"))
        dst = named["self"].device if "src" in named else named.get("device")
        if src.device.type != "cpu" or dst is None:
            return None
        return src if torch.device(dst).type == self.device_type else None

    @staticmethod
    def _sync_kind(func: Any, args: tuple[Any, ...], kwargs: Any, tensors: list[Any]) -> str:
        packet = func.overloadpacket
        if packet is aten._local_scalar_dense:
            return "value to host"
        if packet is aten.lift_fresh:  # `torch.tensor(data, device=...)`: a blocking copy
            return "blocking host to device copy"
        if packet in _SHAPE_SYNCS:
            return "data-dependent shape"
        if packet is aten.repeat_interleave and func is aten.repeat_interleave.Tensor:
            return "" if kwargs.get("output_size") is not None else "data-dependent shape"
        if packet is aten.index and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        ):
            return "boolean mask"
        if packet in _COPIES:
            named = _named(func, args, kwargs)
            src = named.get("src", named.get("self"))
            dst = named.get("device") if "src" not in named else named["self"].device
            dst_type = torch.device(dst).type if dst is not None else src.device.type
            if src.device.type == dst_type:
                return ""
            if dst_type == "cpu":
                return "device to host copy"
            return "" if named.get("non_blocking") else "blocking host to device copy"
        return ""

    # -- summaries ----------------------------------------------------------------------------

    def seconds(self, hw: Hardware) -> float:
        return sum(r.seconds(hw) for r in self.records)

    def syncs(self, phases: tuple[str, ...] | None = None) -> list[OpRecord]:
        return [r for r in self.records if r.sync and (phases is None or r.phase in phases)]

    def pageable_copies(self, phases: tuple[str, ...] | None = None) -> list[OpRecord]:
        """The host-to-device copies from pageable memory (module docstring)."""
        return [
            r
            for r in self.records
            if r.copy == "pageable" and (phases is None or r.phase in phases)
        ]

    def host_work(self, phase: str) -> tuple[int, float]:
        """(ops, bytes) of the host work of `phase`: ops on host tensors and host-to-device
        copies (numpy work before them is not seen, but its results are what they copy)."""
        work = [r for r in self.records if r.phase == phase and (r.host or r.copy)]
        return len(work), sum(r.host_bytes for r in work)

    @property
    def launches(self) -> int:
        """Kernel launches the host makes (a replayed graph: one)."""
        return sum(r.host_launches for r in self.records)

    @property
    def captured_launches(self) -> int:
        """Kernel launches inside replayed graphs."""
        return sum(r.launches for r in self.records if r.captured and not r.host)

    @property
    def gemm_flops(self) -> float:
        return sum(r.flops for r in self.records if r.gemm)


def _op_bytes(packet: Any, args: tuple[Any, ...], out: Any, tensors: list[Any]) -> float:
    outs = tensors_of(out)
    if packet in _GATHERS:  # reads the rows it gathers (and the index), writes them
        index = [t for t in tensors[1:] if not t.is_floating_point()]
        return 2 * nbytes(outs) + nbytes(index)
    if packet in _SCATTERS_IN_PLACE:  # reads the values (and the index), writes them
        return 2 * nbytes(tensors[1:])
    return nbytes(tensors) + nbytes(outs)


def _stand_in(func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
    """A meta run's stand-in for an op that needs values: an upper-bound shape, or a zero."""
    packet = func.overloadpacket
    x = args[0] if args else None
    if packet is aten._local_scalar_dense:
        return False if x.dtype == torch.bool else 0
    if packet is aten.nonzero:
        return x.new_empty((x.numel(), x.dim()), dtype=torch.long)
    if packet is aten.bincount:
        return x.new_empty((max(int(kwargs.get("minlength", args[2] if len(args) > 2 else 0)), 1),))
    if packet in (aten.masked_select, aten.repeat_interleave):
        return x.new_empty((x.numel(),))
    if packet in _COPIES:  # to the host (a copy to the device runs: the meta output is free)
        named = _named(func, args, kwargs)
        if "src" in named:
            return args[0] if args[0].device.type == "cpu" else None
        if named.get("device") is None or torch.device(named["device"]).type != "cpu":
            return None
        return torch.zeros(x.shape, dtype=named.get("dtype") or x.dtype, device="cpu")
    return None


def _named(func: Any, args: tuple[Any, ...], kwargs: Any) -> dict[str, Any]:
    """An op's arguments by their schema names."""
    names = [a.name for a in func._schema.arguments]
    return {
        **dict(zip(names, args, strict=False)),
        **kwargs,
    }  # runs as is (e.g. a boolean index into a host tensor)


# -- custom ops: the Triton kernels CUDA runs ----------------------------------------------


def custom_records(acct: Accountant, func: Any, args: tuple[Any, ...], out: Any) -> list[OpRecord]:
    name = func.overloadpacket.__name__
    rule = CUSTOM_RULES.get(name)
    io = nbytes(tensors_of(args, out))
    if rule is None:
        return [OpRecord(f"canvas.{name}", acct.current, bytes=io)]
    return [OpRecord(f"canvas.{r.name}", acct.current, **r.cost) for r in rule(acct, args, out)]
