"""The memory plan: what the KV pools, the sampler and one step may take of the device.

After the weights load, the memory left (`device_memory`: CUDA's free memory, or the host's
available RAM) is shared out by `plan_memory`:

    usable = gpu_memory_utilization × total − what is already taken (weights, CUDA context)
             − the CPU kernels' copies of the weights, made after the plan (`packed_bytes`)
    usable ≥ one step's transient  (its tokens' activations, its sampled positions' logits
                                    and the logits filters' workspace)
           + with --cuda-graphs, what their memory pools hold (`graph_pool_bytes`)
           + running × (a sliding-window ring + a sampler slot)
           + the full-attention pool (enough for every running request at max_model_len)

Canvases per step and running requests are chosen together: the most canvases per step such
that every running request's canvas can join one step, then as many running requests as the
rest holds (up to --max-num-seqs); the full-attention pool takes what is left. The engine
allocates exactly the plan (`Engine.plan`); `canvas plan` prints it for a model built on the
meta device and a GPU from `GPUS`, without one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.device.graphs import HEAD_ROWS
from engine.device.step_buffers import bucket_of, bucket_sizes
from engine.device.weight_copies import packed_bytes
from engine.kv_pages import PageGeometry
from engine.logits.filters import FILTER_CHUNK_ELEMENTS
from engine.model import BACKBONES, DiffusionLM
from engine.model.config import LayerType, ModelConfig, TextConfig
from engine.model.quant import FP8, fp8_candidates, make_fp8
from kernels.reference_sampler import PROBS_CHUNK_BYTES

if TYPE_CHECKING:
    from engine.engine import EngineConfig

GB = 10**9
# On a CPU the full-attention pool is capped at this many positions unless --kv-cache-tokens
# asks for more: host RAM is shared with everything else on the machine, and small models keep
# the pool they always had.
CPU_KV_CACHE_TOKENS = 131_072
# `canvas plan` only (a live engine reads it from the device): what the CUDA context, cuBLAS
# and Triton take before the pools are allocated.
CUDA_CONTEXT_BYTES = 1 << 30
# The top_k / top_p / min_p filter (`engine.logits.filters`) works in place on at most
# FILTER_CHUNK_ELEMENTS logits at once, whatever the step: per element, top_p's sort (fp32
# values, int64 indices), its softmax and cumulative sums, and the masks (4 + 8 + 4 + 4 + 1 + 1
# and a little). Beside it a filtered row whose raw logits are read later (log-probabilities, a
# grammar's repair) keeps a copy of them: held here for one canvas; a step with more such rows
# that runs out of memory is run again one request at a time (`Engine.execute`).
FILTER_BYTES_PER_ENTRY = 25
# Exact numerics' sampler keeps about seven fp32 copies of a canvas's logits.
EXACT_LOGIT_COPIES = 7


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU `canvas plan` assumes: `total_bytes` is what CUDA reports as its memory;
    `capability`, its compute capability (which FP8 kernels it runs: `Fp8Paths`)."""

    name: str
    total_bytes: int
    capability: tuple[int, int]


GPUS = {
    "a100": Gpu("A100 80 GB (81,920 MiB)", 81_920 << 20, (8, 0)),
    "h100": Gpu("H100 80 GB (81,559 MiB)", 81_559 << 20, (9, 0)),
    "h200": Gpu("H200 141 GB (143,771 MiB)", 143_771 << 20, (9, 0)),
}
# The Triton backend's FP8 kernels that read FP8 operands instead of dequantizing, and the
# compute capabilities they are bound on (`kernels.triton_fp8.scaled_mm_rowwise`: sm_90 only;
# `kernels.triton_fp8.e4m3_kernels`: from sm_89); tests hold these to those predicates.
TRITON = "triton"
SCALED_MM_CAPABILITY = (9, 0)
E4M3_CAPABILITY = (8, 9)
# `kernels.triton_fp8.fp8_linear` takes `_scaled_mm` only where both of a weight's dimensions
# are multiples of this; another weight's calls dequantize it.
SCALED_MM_MULTIPLE = 16


@dataclass(frozen=True, slots=True)
class Fp8Paths:
    """Which FP8 kernels an engine runs, which decides what they hold beside the weights.
    `scaled_mm`: dense projections through `torch._scaled_mm` over a per-token FP8 copy of
    their bf16 input (else each call dequantizes its weight); `fp8_experts`: the expert GEMM
    reads the FP8 experts (else each call dequantizes a layer's experts)."""

    scaled_mm: bool = False
    fp8_experts: bool = False

    @classmethod
    def bound(cls, backend: str, capability: tuple[int, int] | None) -> Fp8Paths:
        """What kernel backend `backend` binds on a CUDA device of compute `capability` (None:
        a CPU): the Triton backend's FP8 kernels where the capability has them; every other
        backend, and the Triton backend on sm_80, dequantizes."""
        if backend != TRITON or capability is None:
            return cls()
        return cls(capability == SCALED_MM_CAPABILITY, capability >= E4M3_CAPABILITY)

    @classmethod
    def of(cls, model: DiffusionLM) -> Fp8Paths:
        """The paths of `model`'s bound kernels on the device it is loaded on."""
        device = model.embed_tokens.weight.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        return cls.bound(model.kernels.backend, capability)


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """`gpu_memory_utilization`: the share of the device's memory the engine may hold in all
    (weights included; on a CPU, of the RAM available at start). `max_model_len`: the longest
    context a request may have (None: the model's max_position_embeddings)."""

    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")


class MemoryPlanError(ValueError):
    """The device cannot hold what the flags ask for; the message names the flags."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The memory a plan shares out: `usable_bytes` (the device's total times
    --gpu-memory-utilization, less what was taken before the plan) of `total_bytes`."""

    name: str
    total_bytes: int
    taken_bytes: int  # before the plan: the weights, the CUDA context (CPU: already left out)
    host: bool = False  # host RAM: the full-attention pool is capped (CPU_KV_CACHE_TOKENS)

    def usable_bytes(self, utilization: float) -> int:
        return int(utilization * self.total_bytes) - self.taken_bytes


def available_ram() -> int:
    """The host's available RAM: /proc/meminfo's MemAvailable, else free pages (sysconf)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_memory(device: torch.device) -> DeviceMemory:
    """What `device` has now: CUDA's total and free memory, or the host's available RAM."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the caching allocator keeps unused count as free
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(f"{device} ({torch.cuda.get_device_name(device)})", total, total - free)
    return DeviceMemory("cpu (available RAM)", available_ram(), 0, host=True)


def assumed_gpu(gpu: str, weights_bytes: int) -> DeviceMemory:
    """A GPU of `GPUS` after `weights_bytes` of weights and the CUDA context loaded."""
    spec = GPUS[gpu]
    return DeviceMemory(spec.name, spec.total_bytes, weights_bytes + CUDA_CONTEXT_BYTES)


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What a plan needs of a model: its weights' bytes and the sizes of what it allocates."""

    weights_bytes: int
    canvas_length: int
    max_position: int
    kv_bytes_per_position: dict[LayerType, int]  # K and V of every layer of the type
    slot_bytes: int  # one running request's sampler state (canvas, draft, soft input)
    token_bytes: int  # one token of a step: its activations (and FP8 copies: `fp8_workspace`)
    logit_bytes: int  # one sampled position: its logits in the sampler
    filter_bytes: int  # the filters' workspace and one canvas's raw logits kept beside it
    text: TextConfig = field(repr=False)
    dequant_bytes: int = 0  # FP8 weights dequantized for one kernel call (`fp8_workspace`)
    packed_bytes: int = 0  # what the bound CPU kernels copy of the weights (`packed_bytes`)
    dtype_bytes: int = 2  # one activation value (the model's dtype)


def model_shapes(
    model: DiffusionLM, exact: bool = False, fp8: Fp8Paths | None = None
) -> ModelShapes:
    """The shapes of `model` (loaded, or built on the meta device: nothing is read), with
    `exact` numerics' sampler or the fast one, and FP8 weights run by the kernels `fp8` names
    (None: those `model` has bound, on its device)."""
    cfg = model.cfg
    dtype = model.embed_tokens.weight.dtype
    size = dtype.itemsize
    tensors = [*model.parameters(), *model.buffers()]
    kv = dict.fromkeys(LayerType, 0)
    for spec in cfg.layers:
        kv[spec.layer_type] += 2 * spec.num_kv_heads * spec.head_dim * size
    length = model.config.canvas_length
    vocab = cfg.vocab_size
    # The fp32 logits (exact numerics' copies of them) and the head's output while it is cast.
    sampler = (4 * (EXACT_LOGIT_COPIES if exact else 1) + size) * vocab
    dequant, fp8_token = fp8_workspace(model, dtype, Fp8Paths.of(model) if fp8 is None else fp8)
    return ModelShapes(
        weights_bytes=sum(t.numel() * t.element_size() for t in tensors),
        canvas_length=length,
        max_position=cfg.max_position_embeddings,
        kv_bytes_per_position=kv,
        slot_bytes=length * (2 * 8 + cfg.hidden_size * size),
        token_bytes=activation_bytes_per_token(cfg, size) + fp8_token,
        logit_bytes=sampler,
        filter_bytes=FILTER_BYTES_PER_ENTRY * min(FILTER_CHUNK_ELEMENTS, length * vocab)
        + 4 * length * vocab,
        text=cfg,
        dequant_bytes=dequant,
        packed_bytes=packed_bytes(model),
        dtype_bytes=size,
    )


def fp8_workspace(model: DiffusionLM, dtype: torch.dtype, fp8: Fp8Paths) -> tuple[int, int]:
    """What `model`'s FP8 weights' kernels hold beside them, activations of `dtype`: (bytes of
    one call's dequantized weights, bytes per token). A dequantizing call
    (`kernels.reference_fp8`) holds the fp32 product of a weight and its copy in `dtype`; the
    experts' holds both expert weights in `dtype` beside the larger one's fp32 product. A
    `_scaled_mm` projection (bf16, both dimensions multiples of 16) holds its input's FP8 copy
    and fp32 per-token scale; the FP8 expert GEMM, what the unquantized one does. (0, 0)
    without FP8 weights."""
    size = dtype.itemsize
    scaled_mm = fp8.scaled_mm and dtype == torch.bfloat16
    dequant = per_token = 0
    for module in model.modules():
        fp8_weights = [p for p in module.parameters(recurse=False) if p.dtype == FP8]
        sizes = [p.numel() for p in fp8_weights]
        if any(p.dim() == 3 for p in fp8_weights):  # the experts: [E, out, in]
            if not fp8.fp8_experts:
                dequant = max(dequant, sum(sizes) * size + max(sizes) * 4)
            continue
        for weight in fp8_weights:  # [out, in]
            if scaled_mm and all(d % SCALED_MM_MULTIPLE == 0 for d in weight.shape):
                per_token = max(per_token, weight.shape[-1] + 4)
            else:
                dequant = max(dequant, weight.numel() * (size + 4))
    return dequant, per_token


def activation_bytes_per_token(cfg: TextConfig, size: int) -> int:
    """An upper bound on one token's live tensors within a layer (a layer's are freed before
    the next): the residual, its norms and branch outputs, q and the attention output at the
    widest head, k and v, the dense MLP's gate, up and product, each of its top_k expert pairs'
    input, gate, up, product and output, and the fp32 router logits."""
    head = max(spec.head_dim for spec in cfg.layers)
    kv = max(2 * spec.num_kv_heads * spec.head_dim for spec in cfg.layers)
    hidden, moe = cfg.hidden_size, cfg.moe_intermediate_size
    elements = 6 * hidden + 2 * cfg.num_heads * head + kv + 3 * cfg.intermediate_size
    elements += cfg.top_k_experts * (2 * hidden + 3 * moe)
    return elements * size + 4 * cfg.num_experts


def meta_model(config: ModelConfig, dtype: torch.dtype, quantization: str = "auto") -> DiffusionLM:
    """The engine's model for `config` on the meta device: shapes and sizes, no memory.
    `quantization` "fp8": its projections and experts FP8 with their fp32 scales, as
    `--quantization fp8` loads them (`engine.model.quant`)."""
    with torch.device("meta"):
        model = BACKBONES[config.model_type](config)
    model = model.to(dtype)
    if quantization == "fp8":
        make_fp8(model, [name for group in fp8_candidates(model).values() for name in group])
    return model


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the engine allocates: `max_running_requests` sliding-window rings and sampler slots,
    a full-attention pool of `full_pages`, and room for one step of `tokens_per_step` tokens
    (at most `canvases_per_step` canvases). `limited_by`: what bounds the running requests
    (--max-num-seqs, or memory)."""

    device: str
    total_bytes: int
    usable_bytes: int
    weights_bytes: int
    packed_bytes: int  # the CPU kernels' copies of the weights, left out of `usable_bytes`
    gpu_memory_utilization: float
    max_model_len: int
    geometry: PageGeometry
    full_pages: int
    sliding_pages: int
    max_running_requests: int
    tokens_per_step: int
    canvases_per_step: int
    kv_bytes: int
    slot_bytes: int
    step_bytes: int
    limited_by: str
    graph_bytes: int = 0  # of step_bytes, what --cuda-graphs' pools hold (`graph_pool_bytes`)

    @property
    def kv_positions(self) -> dict[str, int]:
        """KV positions per pool (a sliding ring's positions are reused as it advances)."""
        size = self.geometry.page_size
        return {"full": self.full_pages * size, "sliding": self.sliding_pages * size}

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "total_bytes": self.total_bytes,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "usable_bytes": self.usable_bytes,
            "weights_bytes": self.weights_bytes,
            "packed_bytes": self.packed_bytes,
            "max_model_len": self.max_model_len,
            "kv_positions": self.kv_positions,
            "kv_bytes": self.kv_bytes,
            "max_running_requests": self.max_running_requests,
            "running_limited_by": self.limited_by,
            "canvases_per_step": self.canvases_per_step,
            "tokens_per_step": self.tokens_per_step,
            "step_bytes": self.step_bytes,
            "graph_bytes": self.graph_bytes,
            "slot_bytes": self.slot_bytes,
        }

    def describe(self) -> str:
        kv = self.kv_positions
        copies = f", their CPU kernels' copies {self.packed_bytes / GB:.1f} GB"
        packed = copies if self.packed_bytes else ""
        return (
            f"Memory plan on {self.device}: {self.usable_bytes / GB:.1f} GB for the KV cache and "
            f"the step, of {self.total_bytes / GB:.1f} GB at --gpu-memory-utilization "
            f"{self.gpu_memory_utilization} (weights {self.weights_bytes / GB:.1f} GB{packed}); "
            f"{self.max_running_requests} running requests at --max-model-len "
            f"{self.max_model_len} (bounded by {self.limited_by}); KV {self.kv_bytes / GB:.1f} GB: "
            f"{kv['full']:,} full-attention positions, {kv['sliding']:,} sliding-window "
            f"positions in rings; {self.canvases_per_step} canvases per step "
            f"({self.tokens_per_step:,} tokens, {self.step_bytes / GB:.1f} GB of activations "
            f"and sampler logits{self.graph_note()}); sampler slots {self.slot_bytes / GB:.2f} GB"
        )

    def graph_note(self) -> str:
        return (
            f", {self.graph_bytes / GB:.1f} GB of it CUDA graphs' (--cuda-graphs: the head and "
            f"sampler captured up to {HEAD_ROWS} canvases)"
            if self.graph_bytes
            else ""
        )


def plan_memory(shapes: ModelShapes, config: EngineConfig, memory: DeviceMemory) -> MemoryPlan:
    """The plan for a model of `shapes` run as `config` describes on `memory`. Raises
    MemoryPlanError, naming the flags, when not even one running request with one canvas per
    step fits, or --max-model-len exceeds the model's positions."""
    mem, sched, cfg = config.memory, config.scheduler, shapes.text
    length = mem.max_model_len or shapes.max_position
    if length > shapes.max_position:
        raise MemoryPlanError(
            f"--max-model-len {length} exceeds the model's max_position_embeddings "
            f"({shapes.max_position})"
        )
    geometry = PageGeometry(
        page_size=config.page_size,
        sliding_window=cfg.sliding_window,
        max_pass_tokens=max(sched.max_prefill_chunk, shapes.canvas_length),
        has_full=any(not s.is_sliding for s in cfg.layers),
        has_sliding=any(s.is_sliding for s in cfg.layers),
    )
    page = config.page_size
    full_page_bytes = shapes.kv_bytes_per_position[LayerType.FULL] * page
    ring = geometry.sliding_ring(length)
    request_bytes = ring * page * shapes.kv_bytes_per_position[LayerType.SLIDING]
    request_bytes += shapes.slot_bytes
    cap = max(CPU_KV_CACHE_TOKENS, length) if memory.host else None

    def full_pages(running: int) -> int:  # what the pool must hold for `running` requests
        if config.kv_cache_tokens is not None:
            return config.kv_cache_tokens // page
        positions = running * length if cap is None else min(running * length, cap)
        return -(-positions // page)

    def most_running(free: int) -> int:
        return largest(
            sched.max_num_seqs,
            lambda n: n * request_bytes + full_pages(n) * full_page_bytes <= free,
        )

    usable = memory.usable_bytes(mem.gpu_memory_utilization) - shapes.packed_bytes
    tokens, length_of_canvas = sched.max_num_batched_tokens, shapes.canvas_length
    most_canvases = max(1, min(tokens // length_of_canvas, sched.max_num_seqs))
    for canvases in range(most_canvases, 0, -1):
        if canvases < most_canvases:  # fewer canvases per step: a smaller step
            tokens = canvases * length_of_canvas
        step_bytes = step_transient(shapes, max(tokens, length_of_canvas), sched.max_num_seqs)
        graphs = graph_pool_bytes(shapes, sched.max_num_seqs, canvases) if config.cuda_graphs else 0
        step_bytes += graphs
        running = most_running(usable - step_bytes)
        if running >= canvases:
            break
    if running < 1:
        need = step_bytes + request_bytes + full_pages(1) * full_page_bytes
        raise no_room(config, memory, length, need)
    free = usable - step_bytes - running * request_bytes
    if config.kv_cache_tokens is None and full_page_bytes:
        most = free // full_page_bytes
        full = most if cap is None else min(most, cap // page)
    else:
        full = full_pages(running)
    return MemoryPlan(
        device=memory.name,
        total_bytes=memory.total_bytes,
        usable_bytes=usable,
        weights_bytes=shapes.weights_bytes,
        packed_bytes=shapes.packed_bytes,
        gpu_memory_utilization=mem.gpu_memory_utilization,
        max_model_len=length,
        geometry=geometry,
        full_pages=full,
        sliding_pages=running * ring,
        max_running_requests=running,
        tokens_per_step=tokens,
        canvases_per_step=min(canvases, running),
        kv_bytes=full * full_page_bytes + running * (request_bytes - shapes.slot_bytes),
        slot_bytes=running * shapes.slot_bytes,
        step_bytes=step_bytes,
        limited_by="--max-num-seqs" if running == sched.max_num_seqs else "memory",
        graph_bytes=graphs,
    )


def step_transient(shapes: ModelShapes, tokens: int, max_rows: int) -> int:
    """One step of `tokens` tokens in at most `max_rows` rows: every token's activations, the
    logits of the positions sampled (at most a canvas per row), the filters' workspace and
    the FP8 weights one kernel call dequantizes."""
    sampled = min(tokens, max_rows * shapes.canvas_length)
    workspace = shapes.filter_bytes + shapes.dequant_bytes
    return tokens * shapes.token_bytes + sampled * shapes.logit_bytes + workspace


def graph_pool_bytes(shapes: ModelShapes, max_rows: int, canvases: int) -> int:
    """What `--cuda-graphs`' memory pools hold (`engine.device.graphs`,
    `engine.device.sampler_graphs`), apart from the eager steps' memory, for the buckets of
    `max_rows` canvases that steps of at most `canvases` canvases use: the largest bucket's
    forward activations (the smaller buckets' captures reuse them); each bucket's static canvas
    ids, self-conditioning inputs and output; and in the buckets of at most `HEAD_ROWS`
    canvases, each one's fp32 logits and the sampler's static inputs and new state, beside the
    largest one's head projection and soft-embedding probabilities (reused). All-AR steps'
    graphs (`engine.device.ar_steps`), one per bucket of up to `max_rows` rows, in the same
    pool: their forward activations where the largest one's tokens outnumber the canvases',
    and each bucket's output (its rows' hidden states, or in the buckets of at most `HEAD_ROWS`
    rows their fp32 logits)."""
    length, hidden, size = shapes.canvas_length, shapes.text.hidden_size, shapes.dtype_bytes
    vocab = shapes.text.vocab_size
    sizes = bucket_sizes(max_rows)
    largest = bucket_of(min(canvases, max(sizes)), sizes) or 1
    buckets = [b for b in sizes if b <= largest]
    total = max(max(buckets) * length, max(sizes)) * shapes.token_bytes
    total += sum(buckets) * length * (8 + 2 * hidden * size)
    total += sum(b * (4 * vocab if b <= HEAD_ROWS else hidden * size) for b in sizes)
    headed = [b for b in buckets if b <= HEAD_ROWS]
    if headed:
        # per position: the logits; ids, canvas, draft, the new canvas and draft (int64), the
        # soft inputs and the new soft embedding, the sampler's fp32 and int64 results
        total += sum(headed) * length * (4 * vocab + 5 * 8 + 2 * hidden * size + 32)
        most = max(headed) * length * vocab * size
        total += most + min(PROBS_CHUNK_BYTES, most)
    return total


def no_room(config: EngineConfig, memory: DeviceMemory, length: int, need: int) -> MemoryPlanError:
    """The error of a plan that cannot hold one running request with one canvas per step,
    which takes `need` bytes."""
    utilization = config.memory.gpu_memory_utilization
    usable = memory.usable_bytes(utilization)
    lower = "--kv-cache-tokens" if config.kv_cache_tokens is not None else "--max-model-len"
    return MemoryPlanError(
        f"the memory plan cannot hold one canvas on {memory.name}: "
        f"{max(usable, 0) / GB:.2f} GB are left at --gpu-memory-utilization {utilization} of "
        f"{memory.total_bytes / GB:.2f} GB ({memory.taken_bytes / GB:.2f} GB taken by the "
        f"weights and the CUDA context), and one running request at --max-model-len {length} "
        f"with one canvas per step needs {need / GB:.2f} GB (--max-num-seqs "
        f"{config.scheduler.max_num_seqs}): raise --gpu-memory-utilization or lower {lower}"
    )


def largest(most: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, most] with fits(n), for a `fits` true up to some n and false after."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
