"""The GPU benchmark's measurements below the engine: the machine's ceilings (copy bandwidth,
GEMM rate) and each kernel the model has bound, timed alone at one batch of canvases with the
bytes and FLOPs a perfect kernel would need (see `loadtest.gpu.bench`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.engine import EngineConfig
from engine.model import DiffusionLM
from kernels.reference import PagedRows, prefix_range

logger = logging.getLogger("gpu_bench")


@contextmanager
def recorded(errors: list[str], label: str) -> Iterator[None]:
    """Record an exception in `errors` (with its traceback in the log) and carry on: one
    failing kernel or batch size must not lose the others' measurements."""
    try:
        yield
    except Exception as exc:
        logger.exception("%s failed", label)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        errors.append(f"{label}: {type(exc).__name__}: {first}")


class Timer:
    """Mean time of a call: CUDA events on the GPU (after 2 warm-up calls), wall time on CPU."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.device, self.iters = device, iters
        self.warmup = 2 if device.type == "cuda" else 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(self.iters):
                fn()
            return (time.perf_counter() - start) / self.iters
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(self.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3 / self.iters


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    gemm_flop_per_s: float  # square GEMM in the model's dtype


def measure_ceilings(timer: Timer, dtype: torch.dtype, small: bool) -> Ceilings:
    """Copy 2 GiB and multiply 8192² matrices (`small`: 8 MiB and 128², for dry runs)."""
    numel = (8 << 20) // 4 if small else (2 << 30) // 2
    src = torch.ones(numel, dtype=dtype, device=timer.device)
    dst = torch.empty_like(src)
    copy_s = timer.seconds(lambda: dst.copy_(src))
    n = 128 if small else 8192
    a, b = (torch.randn(n, n, device=timer.device).to(dtype) for _ in range(2))
    gemm_s = timer.seconds(lambda: torch.mm(a, b))
    return Ceilings(2 * src.nbytes / copy_s, 2 * n**3 / gemm_s)


@dataclass(frozen=True, slots=True)
class KernelTiming:
    name: str
    canvases: int
    ms: float
    bytes: float  # what a perfect kernel moves: inputs read once, outputs written once
    flops: float

    def rates(self, c: Ceilings) -> dict[str, float]:
        bw, fl = self.bytes / self.ms * 1e3, self.flops / self.ms * 1e3
        return {
            "gb_per_s": bw / 1e9,
            "copy_share": bw / c.copy_bytes_per_s,
            "tflop_per_s": fl / 1e12,
            "gemm_share": fl / c.gemm_flop_per_s,
        }


def paged_rows(
    canvases: int,
    prefix: int,
    length: int,
    window: int,
    page: int,
    decode: bool,
    dev: torch.device,
) -> tuple[PagedRows, int]:
    """`canvases` rows, each a canvas of `length` after `prefix` cached positions in its own
    pages; pages wholly below a sliding window are released (-1), as the engine's ring leaves
    them. Returns the rows and the number of pages used."""
    per_row = -(-(prefix + length) // page)
    lo, _ = prefix_range(prefix, window)
    tables, next_page = [], 0
    for _ in range(canvases):
        table = []
        for i in range(per_row):
            live = (i + 1) * page > lo
            table.append(next_page if live else -1)
            next_page += int(live)
        tables.append(table)
    n = [length] * canvases
    return PagedRows.build([prefix] * canvases, n, [decode] * canvases, tables, dev), next_page


def time_kernels(
    model: DiffusionLM, canvases: int, prefix: int, iters: int, errors: list[str]
) -> list[KernelTiming]:
    """Each kernel the model has bound, alone, at `canvases` canvases after `prefix` cached
    positions, with the model's own weights (layer 0, and a full layer for its attention).
    A kernel that fails is recorded in `errors` and skipped, with the kernels that need its
    output."""
    cfg, length = model.cfg, model.config.canvas_length
    weight = model.embed_tokens.weight
    dev, dtype = weight.device, weight.dtype
    n, el, timer = canvases * length, weight.element_size(), Timer(dev, iters)
    out: list[KernelTiming] = []

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev, dtype=dtype)

    def add(name: str, fn: Callable[[], object], moved: float, flops: float) -> None:
        with recorded(errors, f"{name} at {canvases} canvases"):
            out.append(KernelTiming(name, canvases, timer.seconds(fn) * 1e3, moved, flops))

    _time_attention(model, canvases, prefix, add, randn)
    layer, ks = model.layers[0], model.layers[0].kernels
    hidden, top_k, experts = cfg.hidden_size, cfg.top_k_experts, cfg.num_experts
    x = randn(n, hidden)
    norm = layer.input_layernorm.weight
    eps, rows_bytes = cfg.rms_norm_eps, n * hidden * el
    add("rms_norm", lambda: ks.rms_norm(x, norm, eps), 2 * rows_bytes, 0.0)
    # A layer's fused tails (one launch each): the post-attention norm with its residual add,
    # the two pre-norms of one input, the branches' close, the MLP's gelu(gate) * up.
    h, moe_out, scale = randn(n, hidden), randn(n, hidden), layer.decoder_layer_scalar
    add("add_rms_norm", lambda: ks.add_rms_norm(x, h, norm, eps), 3 * rows_bytes, 0.0)
    add("rms_norm_pair", lambda: ks.rms_norm_pair(x, norm, norm, eps), 3 * rows_bytes, 0.0)
    close = (h, moe_out, x, norm, norm, norm, scale, eps)
    add("close_layer", lambda: ks.close_layer(*close), 4 * rows_bytes, 0.0)
    gate = randn(n, cfg.intermediate_size)
    act = cfg.hidden_activation
    add("gated_act", lambda: ks.gated_act(gate, gate, act), 3 * gate.numel() * el, 0.0)
    r = layer.router
    route = (x, r.scale, r.proj.weight, r.per_expert_scale, top_k, cfg.rms_norm_eps)
    add(
        "route_experts",
        lambda: ks.route_experts(*route),
        (n + experts) * hidden * el,
        2 * n * hidden * experts,
    )
    expert = 3 * cfg.moe_intermediate_size * hidden  # weights of one expert
    with recorded(errors, f"fused_moe at {canvases} canvases (routing its input)"):
        weights, ids = ks.route_experts(*route)
        moe = (x, layer.experts.gate_up_proj, layer.experts.down_proj, weights, ids)
        moved = (int(ids.unique().numel()) * expert + 2 * n * hidden) * el
        add("fused_moe", lambda: ks.fused_moe(*moe), moved, 2 * n * top_k * expert)
    _time_head_and_sampler(model, canvases, x, add, errors)
    return out


Add = Callable[[str, Callable[[], object], float, float], None]


def _time_attention(
    model: DiffusionLM,
    canvases: int,
    prefix: int,
    add: Add,
    randn: Callable[..., torch.Tensor],
) -> None:
    """`time_kernels`' attention part: a sliding and a full layer's attention, q/k/v norms and
    RoPE, and the KV write of a commit pass."""
    cfg, length = model.cfg, model.config.canvas_length
    n, el = canvases * length, model.embed_tokens.weight.element_size()
    dev, page = model.embed_tokens.weight.device, EngineConfig().page_size
    for full in (False, True):
        layer = next(x for x in model.layers if x.self_attn.spec.is_sliding != full)
        spec, ks = layer.self_attn.spec, layer.self_attn.kernels
        kv, d, heads = spec.num_kv_heads, spec.head_dim, cfg.num_heads
        window = 0 if full else cfg.sliding_window
        rows, pages = paged_rows(canvases, prefix, length, window, page, True, dev)
        pools = randn(pages, kv, page, d), randn(pages, kv, page, d)
        q, k, v = randn(n, heads, d), randn(n, kv, d), randn(n, kv, d)
        lo, hi = prefix_range(prefix, window)
        moved = (2 * n * heads * d + 2 * n * kv * d + 2 * canvases * (hi - lo) * kv * d) * el
        flops = 4 * heads * d * length * (hi - lo + length) * canvases
        name = f"attention {'full' if full else 'sliding'}"
        add(name, lambda: ks.canvas_attention(q, k, v, *pools, rows, window, 1.0), moved, flops)  # noqa: B023
        attn, tables = layer.self_attn, (randn(n, d), randn(n, d))
        if attn.qkv_norm:  # a full layer's V is its raw k_proj output (k read twice)
            qkv = (q, k, k if full else v, attn.q_norm.weight, attn.k_norm.weight, *tables)
            moved = (2 * n * heads * d + 4 * n * kv * d + n * d) * el  # cos, sin: half each
            qkv_fn = lambda: ks.qkv_norm_rope(*qkv, cfg.rms_norm_eps)  # noqa: B023, E731
            add(f"qkv_norm_rope {'full' if full else 'sliding'}", qkv_fn, moved, 0.0)
        if not full:  # a commit pass: ENCODE rows write their canvas into the pages
            enc, _ = paged_rows(canvases, prefix, length, window, page, False, dev)
            add("write_kv", lambda: ks.write_kv(k, v, *pools, enc), 4 * n * kv * d * el, 0.0)  # noqa: B023


def _time_head_and_sampler(
    model: DiffusionLM, canvases: int, x: torch.Tensor, add: Add, errors: list[str]
) -> None:
    """`time_kernels`' last part: the LM head, the sampler, the random numbers, the entropy
    acceptance and the soft embedding, on x [n, hidden]."""
    cfg, length, ks = model.cfg, model.config.canvas_length, model.layers[0].kernels
    weight = model.embed_tokens.weight
    dev, el, hidden = weight.device, weight.element_size(), cfg.hidden_size
    n = canvases * length
    vh = cfg.vocab_size * hidden
    add("lm_head (torch)", lambda: model.logits(x), vh * el + 4 * n * cfg.vocab_size, 2 * n * vh)
    logits = torch.randn(n, cfg.vocab_size, device=dev).mul_(3.0)  # [n, V] fp32
    temperature, uniform = torch.full((n,), 0.6, device=dev), torch.rand(n, device=dev)
    add(
        "fused_sample",
        lambda: ks.fused_sample(logits, temperature, uniform),
        4 * n * cfg.vocab_size,
        0.0,
    )
    seeds = torch.arange(canvases, device=dev)[:, None]  # [R, 1]: one stream per canvas
    counters = torch.arange(n, device=dev).view(canvases, length)  # [R, L]
    add("philox_uniform", lambda: ks.philox_uniform(seeds, counters), 12 * n, 0.0)
    with recorded(errors, f"entropy_accept, soft_embedding at {canvases} canvases (sampling)"):
        result = ks.fused_sample(logits, temperature, uniform)
        entropy = result.entropy.view(canvases, length)
        bound = torch.full((canvases,), 0.1, device=dev)
        add("entropy_accept", lambda: ks.entropy_accept(entropy, bound), 5 * n, 0.0)
        scale = float(model.embed_scale)
        add(
            "soft_embedding",
            lambda: ks.soft_embedding(logits, temperature, result.lse, weight, scale),
            4 * n * cfg.vocab_size + vh * el,
            2 * n * vh,
        )
