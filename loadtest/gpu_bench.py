"""GPU benchmark: the machine's ceilings, each Canvas kernel, and a whole denoising step.

    python loadtest/gpu_bench.py              # one H100/H200, real 26B-A4B shapes, ~2-5 minutes
    python loadtest/gpu_bench.py --dry-run    # the same flow on CPU at toy shapes (no GPU)

1. Ceilings: device-to-device copy bandwidth and the bf16 GEMM rate, measured here.
2. Kernels at 1, 4 and 16 canvases (256 positions each, a committed prefix before each canvas):
   time, achieved bytes/s and FLOP/s, and both as a share of the measured ceilings.
3. A whole denoising step of the 26B-A4B text stack with random bf16 weights (30 layers: 5
   sliding then 1 full; dense GeGLU and 128-expert top-8 MoE in every layer; tied 262k-vocab
   head; fused sampler, acceptance and self-conditioning), against the weight-streaming floor
   (all weights read once at the measured copy bandwidth).

The dry run executes every kernel in Triton's CPU interpreter (or the PyTorch twins when triton
is missing) in fp32 at toy shapes; its timings mean nothing, it checks that the flow runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Shapes:
    """The text stack being timed. Defaults: DiffusionGemma 26B-A4B."""

    hidden: int = 2816
    num_layers: int = 30
    window: int = 1024
    num_heads: int = 16
    sliding_kv_heads: int = 8
    sliding_head_dim: int = 256
    full_kv_heads: int = 2
    full_head_dim: int = 512
    dense: int = 2112
    num_experts: int = 128
    top_k: int = 8
    expert: int = 704
    vocab: int = 262_144
    canvas: int = 256
    prefix: int = 2048  # committed positions before each canvas
    page_size: int = 64

    def is_full(self, layer: int) -> bool:
        """5 sliding layers then 1 full, and the last layer is full (as the config parser)."""
        return (layer + 1) % 6 == 0 or layer == self.num_layers - 1

    def attention(self, full: bool) -> tuple[int, int]:
        """(kv heads, head dim) of a layer type."""
        if full:
            return self.full_kv_heads, self.full_head_dim
        return self.sliding_kv_heads, self.sliding_head_dim


TOY = Shapes(
    hidden=64, num_layers=2, window=8, num_heads=4, sliding_kv_heads=2, sliding_head_dim=16,
    full_kv_heads=1, full_head_dim=32, dense=48, num_experts=8, top_k=2, expert=16, vocab=301,
    canvas=16, prefix=21, page_size=8,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float
    gemm_flop_per_s: float


@dataclass(frozen=True, slots=True)
class Measurement:
    name: str
    canvases: int
    seconds: float
    bytes: float  # bytes a perfect kernel moves (0 = not meaningful)
    flops: float


class Bench:
    """Device, dtype, timing and the kernel implementations under test."""

    def __init__(self, device: torch.device, dtype: torch.dtype, ops: ModuleType, iters: int):
        self.device, self.dtype, self.ops, self.iters = device, dtype, ops, iters
        self.warmup = 2 if device.type == "cuda" else 0

    def seconds(self, fn: Callable[[], object]) -> float:
        """Mean wall time of one call (CUDA events on the GPU)."""
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

    def randn(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, std)


def measure_ceilings(bench: Bench, dry_run: bool) -> Ceilings:
    numel = (8 << 20) // 4 if dry_run else (2 << 30) // 2
    src = torch.empty(numel, dtype=bench.dtype, device=bench.device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = bench.seconds(lambda: dst.copy_(src))
    n = 128 if dry_run else 8192
    a, b = bench.randn(n, n), bench.randn(n, n)
    gemm_s = bench.seconds(lambda: torch.mm(a, b))
    return Ceilings(2 * src.nbytes / copy_s, 2 * n**3 / gemm_s)


# -- the model -------------------------------------------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float() if weight is not None else h).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def make_rows(s: Shapes, canvases: int, full: bool, device: torch.device) -> object:
    """DECODE rows (one per canvas) whose prefix lies in their own pages; sliding tables hold
    only the pages of the window (the rest are released, -1)."""
    from kernels.reference import PagedRows, prefix_range

    per_row = -(-(s.prefix + s.canvas) // s.page_size)
    lo, _ = prefix_range(s.prefix, 0 if full else s.window)
    tables, next_page = [], 0
    for _ in range(canvases):
        table = []
        for i in range(per_row):
            live = (i + 1) * s.page_size > lo and i * s.page_size < s.prefix
            table.append(next_page if live else -1)
            next_page += int(live)
        tables.append(table)
    rows = PagedRows.build([s.prefix] * canvases, [s.canvas] * canvases, [True] * canvases,
                           tables, device)  # fmt: skip
    return rows, next_page


def make_layer(bench: Bench, s: Shapes, full: bool) -> dict[str, torch.Tensor]:
    kv_heads, head_dim = s.attention(full)
    h, q_dim, kv_dim = s.hidden, s.num_heads * head_dim, kv_heads * head_dim
    w = {
        "q": bench.randn(q_dim, h, std=h**-0.5),
        "k": bench.randn(kv_dim, h, std=h**-0.5),
        "o": bench.randn(h, q_dim, std=q_dim**-0.5),
        "gate": bench.randn(s.dense, h, std=h**-0.5),
        "up": bench.randn(s.dense, h, std=h**-0.5),
        "down": bench.randn(h, s.dense, std=s.dense**-0.5),
        "router": bench.randn(s.num_experts, h, std=h**-0.5),
        "gate_up": bench.randn(s.num_experts, 2 * s.expert, h, std=h**-0.5),
        "experts_down": bench.randn(s.num_experts, h, s.expert, std=s.expert**-0.5),
    }
    if not full:  # full layers have no v_proj: V is the k_proj output
        w["v"] = bench.randn(kv_dim, h, std=h**-0.5)
    return w


class Model:
    """Random-weight text stack. `set_batch` lays out `canvases` DECODE rows (their prefix KV in
    per-layer pools); `step` is then one denoising step over them."""

    def __init__(self, bench: Bench, s: Shapes) -> None:
        self.bench, self.s = bench, s
        self.layers = [make_layer(bench, s, s.is_full(i)) for i in range(s.num_layers)]
        self.embed = bench.randn(s.vocab, s.hidden)
        self.self_cond = [bench.randn(s.dense, s.hidden, std=s.hidden**-0.5) for _ in range(2)]
        self.self_cond.append(bench.randn(s.hidden, s.dense, std=s.dense**-0.5))
        self.ones = torch.ones(s.hidden, dtype=bench.dtype, device=bench.device)
        self.per_expert_scale = torch.ones(s.num_experts, dtype=bench.dtype, device=bench.device)
        self.canvases = 0

    def weight_bytes(self) -> int:
        """Bytes of every weight a step reads: the weight-streaming floor's numerator."""
        layers = sum(t.nbytes for w in self.layers for t in w.values())
        return layers + self.embed.nbytes + sum(t.nbytes for t in self.self_cond)

    def set_batch(self, canvases: int) -> None:
        s, bench, dev = self.s, self.bench, self.bench.device
        self.canvases = canvases
        self.rows = {full: make_rows(s, canvases, full, dev) for full in (False, True)}
        self.pools = []
        for i in range(s.num_layers):
            full = s.is_full(i)
            kv_heads, head_dim = s.attention(full)
            shape = (self.rows[full][1], kv_heads, s.page_size, head_dim)
            self.pools.append((bench.randn(*shape), bench.randn(*shape)))
        n = canvases * s.canvas
        pos = torch.arange(s.prefix, s.prefix + s.canvas, device=dev).repeat(canvases).float()
        self.rope = {}
        for full in (False, True):
            dim = s.attention(full)[1]
            angle = pos[:, None] * (1e4 ** -(torch.arange(0, dim, 2, device=dev) / dim))
            angle = torch.cat((angle, angle), dim=-1)
            self.rope[full] = (angle.cos().to(bench.dtype), angle.sin().to(bench.dtype))
        self.ids = torch.randint(0, s.vocab, (n,), device=dev)
        self.soft = torch.zeros(n, s.hidden, dtype=bench.dtype, device=dev)
        self.temperature = torch.full((n,), 0.8, device=dev)
        self.seeds = torch.arange(n, dtype=torch.int64, device=dev)
        self.offsets = torch.zeros(n, dtype=torch.int64, device=dev)
        self.bound = torch.full((canvases,), 0.1, device=dev)

    def mlp(
        self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, gate), approximate="tanh") * F.linear(x, up), down)

    def attend(self, h: torch.Tensor, i: int) -> torch.Tensor:
        s, w, full = self.s, self.layers[i], self.s.is_full(i)
        kv_heads, head_dim = s.attention(full)
        n, ones = h.shape[0], self.ones[:head_dim]
        cos, sin = self.rope[full]
        q = rope(rms(F.linear(h, w["q"]).view(n, s.num_heads, head_dim), ones), cos, sin)
        k_raw = F.linear(h, w["k"]).view(n, kv_heads, head_dim)
        v = rms(F.linear(h, w["v"]).view(n, kv_heads, head_dim) if "v" in w else k_raw, None)
        k = rope(rms(k_raw, ones), cos, sin)
        k_pool, v_pool = self.pools[i]
        window = 0 if full else s.window
        out = self.bench.ops.canvas_attention(
            q, k, v, k_pool, v_pool, self.rows[full][0], window, 1.0
        )
        return F.linear(out.view(n, -1), w["o"])

    def layer(self, x: torch.Tensor, i: int) -> torch.Tensor:
        s, w, ops = self.s, self.layers[i], self.bench.ops
        x = x + rms(self.attend(rms(x, self.ones), i), self.ones)
        dense = self.mlp(rms(x, self.ones), w["gate"], w["up"], w["down"])
        weights, ids = ops.route_experts(
            x, self.ones, w["router"], self.per_expert_scale, s.top_k, 1e-6
        )
        moe = ops.fused_moe(rms(x, self.ones), w["gate_up"], w["experts_down"], weights, ids)
        return x + rms(dense + moe, self.ones)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(rms(x, self.ones), self.embed).float()
        return torch.tanh(logits / 30.0) * 30.0

    def step(self) -> None:
        s, ops = self.s, self.bench.ops
        scale = math.sqrt(s.hidden)
        x = F.embedding(self.ids, self.embed) * scale
        x = rms(x + self.mlp(rms(self.soft, self.ones), *self.self_cond), None)
        for i in range(s.num_layers):
            x = self.layer(x, i)
        logits = self.logits(x)
        out = ops.fused_sample(logits, self.temperature, self.seeds, self.offsets)
        accept = ops.entropy_accept(out.entropy.view(self.canvases, s.canvas), self.bound)
        self.soft = ops.soft_embedding(logits, self.temperature, out.lse, self.embed, scale)
        self.ids = torch.where(accept.view(-1), out.sample, self.ids)
        self.offsets += s.vocab  # a fresh counter range per step


# -- measurements ----------------------------------------------------------------------------


def kernel_rows(bench: Bench, model: Model) -> list[Measurement]:
    """Time each kernel once at the model's batch. `bytes` counts what a perfect kernel must
    move (inputs read once, outputs written once; the experts a batch touches)."""
    s, ops, b = model.s, bench.ops, model.canvases
    n, el = b * s.canvas, torch.finfo(bench.dtype).bits // 8
    x = bench.randn(n, s.hidden)
    out: list[Measurement] = []

    def add(name: str, fn: Callable[[], object], moved: float, flops: float) -> None:
        out.append(Measurement(name, b, bench.seconds(fn), moved, flops))

    for full in (False, True):
        kv_heads, d = s.attention(full)
        layer = s.num_layers - 1 if full else 0
        q, k, v = (bench.randn(n, heads, d) for heads in (s.num_heads, kv_heads, kv_heads))
        keys = s.prefix if full else min(s.prefix, s.window - 1)
        args = (q, k, v, *model.pools[layer], model.rows[full][0], 0 if full else s.window, 1.0)
        moved = (2 * n * s.num_heads * d + 2 * n * kv_heads * d + 2 * b * keys * kv_heads * d) * el
        flops = 4 * s.num_heads * d * s.canvas * (keys + s.canvas) * b
        add(f"attention {'full' if full else 'sliding'}", partial(ops.canvas_attention, *args),
            moved, flops)  # fmt: skip
    w = model.layers[0]
    route = partial(ops.route_experts, x, model.ones, w["router"], model.per_expert_scale,
                    s.top_k, 1e-6)  # fmt: skip
    add("route_experts", route, (n + s.num_experts) * s.hidden * el,
        2 * n * s.hidden * s.num_experts)  # fmt: skip
    weights, ids = route()
    touched = int(ids.unique().numel())
    moved = touched * 3 * s.expert * s.hidden * el + 2 * n * s.hidden * el
    add("fused_moe", partial(ops.fused_moe, x, w["gate_up"], w["experts_down"], weights, ids),
        moved, 6 * n * s.top_k * s.expert * s.hidden)  # fmt: skip
    add("lm_head (torch)", partial(F.linear, x, model.embed), s.vocab * s.hidden * el,
        2 * n * s.vocab * s.hidden)  # fmt: skip
    logits = model.logits(x)
    sample = partial(ops.fused_sample, logits, model.temperature, model.seeds, model.offsets)
    add("fused_sample", sample, 4 * n * s.vocab, 0.0)
    result = sample()
    entropy = result.entropy.view(b, s.canvas)
    add("entropy_accept", partial(ops.entropy_accept, entropy, model.bound), 5 * n, 0.0)
    soft = partial(ops.soft_embedding, logits, model.temperature, result.lse, model.embed,
                   math.sqrt(s.hidden))  # fmt: skip
    add("soft_embedding", soft, 4 * n * s.vocab + s.vocab * s.hidden * el,
        2 * n * s.vocab * s.hidden)  # fmt: skip
    return out


def share(value: float, ceiling: float) -> str:
    return f"{100 * value / ceiling:5.1f}%" if value and ceiling else "    -"


def print_table(ceilings: Ceilings, rows: list[Measurement], steps: list[tuple[int, float, int]]):
    print(f"copy bandwidth {ceilings.copy_bytes_per_s / 1e9:8.1f} GB/s   "
          f"GEMM {ceilings.gemm_flop_per_s / 1e12:7.1f} TFLOP/s")  # fmt: skip
    print(f"{'kernel':22} {'canvases':>8} {'ms':>9} {'GB/s':>8} {'of copy':>8} "
          f"{'TFLOP/s':>8} {'of GEMM':>8}")  # fmt: skip
    for m in rows:
        bw, fl = m.bytes / m.seconds, m.flops / m.seconds
        print(f"{m.name:22} {m.canvases:8d} {m.seconds * 1e3:9.3f} {bw / 1e9:8.1f} "
              f"{share(bw, ceilings.copy_bytes_per_s):>8} {fl / 1e12:8.2f} "
              f"{share(fl, ceilings.gemm_flop_per_s):>8}")  # fmt: skip
    print(f"{'denoising step':22} {'canvases':>8} {'ms':>9} {'floor ms':>9} {'floor/step':>10} "
          f"{'ms/canvas':>10}")  # fmt: skip
    for canvases, secs, weight_bytes in steps:
        floor = weight_bytes / ceilings.copy_bytes_per_s
        print(f"{'step':22} {canvases:8d} {secs * 1e3:9.2f} {floor * 1e3:9.2f} "
              f"{share(floor, secs):>10} {secs * 1e3 / canvases:10.2f}")  # fmt: skip


def select_ops(dry_run: bool, twins: bool) -> ModuleType:
    import kernels

    if twins or not kernels.triton_available():
        if not twins:
            print("triton is not installed: timing the PyTorch twins", file=sys.stderr)
        return kernels.reference
    return kernels.triton_ops()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy shapes, interpreter")
    parser.add_argument("--canvases", default=None, help="comma list (default 1,4,16; dry 1,2)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 10; dry 1)")
    parser.add_argument("--twins", action="store_true", help="time the PyTorch twins instead")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="stop starting new batch sizes after this many seconds")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
        device, dtype, shapes = torch.device("cpu"), torch.float32, TOY
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU: use --dry-run to exercise the flow on CPU", file=sys.stderr)
            return 2
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, Shapes()
    default_canvases = "1,2" if args.dry_run else "1,4,16"
    canvases = [int(c) for c in (args.canvases or default_canvases).split(",")]
    iters = args.iters or (1 if args.dry_run else 10)
    torch.manual_seed(0)
    bench = Bench(device, dtype, select_ops(args.dry_run, args.twins), iters)
    ceilings = measure_ceilings(bench, args.dry_run)
    rows: list[Measurement] = []
    steps: list[tuple[int, float, int]] = []
    model = Model(bench, shapes)
    for b in canvases:
        if time.monotonic() - began > args.budget_s:
            print(f"time budget spent: skipping {b} canvases and beyond", file=sys.stderr)
            break
        model.set_batch(b)
        rows += kernel_rows(bench, model)
        steps.append((b, bench.seconds(model.step), model.weight_bytes()))
    print_table(ceilings, rows, steps)
    print(f"({'dry run, ' if args.dry_run else ''}{time.monotonic() - began:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
