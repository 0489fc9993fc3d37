"""Weight-only int8 against fp32 and bf16 on the CPU, at one canvas: does it pay?

    OMP_NUM_THREADS=2 python -m loadtest.cpu.int8_bench [--rounds 7] [--footprint-mb 600]
        [--only bench-tiny bench-small real] [--rows R]

For `bench-tiny`, `bench-small` and the real 26B-A4B text shapes, at one canvas (the preset's
canvas length in rows; `--rows` another count, 1 for an AR step), times one sliding layer's
projections as Canvas runs them today and as weight-only int8 would run them (int8 weights, a
symmetric scale per output channel, activations unquantized):

- dense: q, k, v, o, gate, up, down. `fp32` and `bf16` go through `kernels.native.moe.linear`,
  the dispatch a model's projections take (at one canvas MKL's fp32 GEMM and oneDNN's bf16 one,
  on AMX where the CPU has it). `int8` is PyTorch's weight-only GEMM,
  `aten._weight_int8pack_mm`, with bf16 activations and scales (`int8 f32` with fp32 ones, only
  up to INT8_F32_MAX_ROWS rows: its GEMM is tens of times slower); `int8>bf16` widens the
  weight to bf16 for every call and runs oneDNN's bf16 GEMM. `bf16 reordered` is oneDNN's bf16
  GEMM on a weight reordered once into its own layout (not what Canvas runs: the rate a
  prepacked bf16 weight reaches, against which int8's halved bytes would count).
- experts: each touched expert's gate_up and down on its rows (uniform routing: canvas x top_k
  / experts rows each) with the GeGLU between, the same GEMMs per method (Canvas' bf16 and fp32
  experts of the real shapes run these, the twin's); on the bench checkpoints also
  `moe.fused_moe` (Canvas' native experts) in fp32 and bf16.

A forward reads every layer's weights once, so each method cycles through copies of the layer
(its experts) until its own weights reach the checkpoint's layer count (the bench checkpoints:
their real cache footprint) or `--footprint-mb` (the real shapes: 25B parameters fit no cache);
times are per layer, with the weight bytes each method read per second beside the rate one
`sum` streams memory at (a memory-bound projection runs near it). On the bench checkpoints one
warmed forward at one canvas (`loadtest.cpu.dtype_bench.Step`) in fp32 and bf16 gives the share
the projections take, and the forward int8 would give is estimated as the faster forward with
its dense projections (then also its experts) swapped for int8's. Methods run one after another
in every round (this VM is shared and drifts); each line has the median and the fastest round,
and the fastest of Canvas' fp32/bf16 over the method's, for each.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.build import CheckpointConfig, open_checkpoint
from engine.checkpoints.tiny import (
    PRESETS,
    REAL_26B_A4B_CANVAS_LENGTH,
    REAL_26B_A4B_TEXT_CONFIG,
    make_tiny,
    preset_text_config,
)
from kernels.native import bf16, build, moe
from kernels.native.packing import PackedWeights
from loadtest.cpu.dtype_bench import Step

Linear = Callable[[torch.Tensor, Any], torch.Tensor]
# What Canvas runs today: a ratio's numerator is the fastest of these in its table.
BASELINES = ("fp32", "bf16", "fp32 native", "bf16 native")
# int8 f32's fallback GEMM runs tens of times slower than the others: only where it is cheap.
INT8_F32_MAX_ROWS = 64


@dataclass(frozen=True, slots=True)
class Shapes:
    """One sliding layer of a checkpoint at one canvas."""

    name: str
    rows: int  # the canvas length
    layers: int
    dense: tuple[tuple[int, int], ...]  # (out, in) of q, k, v, o, gate, up, down
    experts: int
    top_k: int
    hidden: int
    inter: int  # an expert's intermediate size

    @property
    def expert_rows(self) -> int:
        return max(1, math.ceil(self.rows * self.top_k / self.experts))

    @property
    def touched(self) -> int:
        return min(self.experts, self.rows * self.top_k)


def shapes_of(name: str, text: dict[str, Any], rows: int) -> Shapes:
    h, hd = text["hidden_size"], text["head_dim"]
    q, kv = text["num_attention_heads"] * hd, text["num_key_value_heads"] * hd
    inter = text["intermediate_size"]
    dense = ((q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter))
    return Shapes(
        name,
        rows,
        text["num_hidden_layers"],
        dense,
        text["num_experts"],
        text["top_k_experts"],
        h,
        text["moe_intermediate_size"],
    )


def quantize(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of w [N, K]: (int8 [N, K], scales [N])."""
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(scale_dtype)


def methods(
    packs: PackedWeights, rows: int
) -> dict[str, tuple[torch.dtype, Callable[..., Any], Linear]]:
    """Per method: activation dtype, how a fp32 weight is stored, and x @ stored^T (`rows`:
    the activations' rows, which oneDNN's weight layout is chosen for; `bf16 reordered` only
    where torch has oneDNN)."""

    def native(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return moe.linear(x, w, [x.shape[0]], packs)

    def int8(x: torch.Tensor, qs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, qs[0], qs[1])

    def widened(x: torch.Tensor, qs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.linear(x, qs[0].to(torch.bfloat16) * qs[1][:, None])

    def reordered(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), rows)

    def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    bf = torch.bfloat16
    chosen: dict[str, tuple[torch.dtype, Callable[..., Any], Linear]] = {
        "fp32": (torch.float32, lambda w: w.clone(), native),
        "bf16": (bf, lambda w: w.to(bf), native),
        "bf16 reordered": (bf, reordered, onednn),
        "int8": (bf, lambda w: quantize(w, bf), int8),
        "int8>bf16": (bf, lambda w: quantize(w, bf), widened),
        "int8 f32": (torch.float32, lambda w: quantize(w, torch.float32), int8),
    }
    if not torch.backends.mkldnn.is_available():  # a torch built without oneDNN
        del chosen["bf16 reordered"]
    return chosen


def stored_bytes(stored: Any) -> int:
    parts = stored if isinstance(stored, tuple) else (stored,)
    return sum(t.numel() * t.element_size() for t in parts)


def copies_for(one: int, layers: int, footprint: int) -> int:
    """Copies of a layer's weights (`one` bytes) that a forward's weights span: the checkpoint's
    layers, or enough to pass `footprint` bytes where `layers` is 0 (weights beyond any cache)."""
    return layers if layers else max(2, math.ceil(footprint / one))


class Cycle:
    """A method's copies of a layer's matrices, each call on the next copy."""

    def __init__(self, copies: list[list[Any]]) -> None:
        self.copies, self.at = copies, 0

    def next(self) -> list[Any]:
        self.at = (self.at + 1) % len(self.copies)
        return self.copies[self.at]


def dense_runner(
    shapes: Shapes,
    method: tuple[torch.dtype, Callable[..., Any], Linear],
    layers: int,
    footprint: int,
) -> tuple[Callable[[], None], int, int]:
    """One layer's dense projections by `method` on the next copy; the copies; the weight
    bytes one call reads."""
    dtype, store, lin = method
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, k, generator=gen) / math.sqrt(k) for n, k in shapes.dense]
    layer = [store(w) for w in masters]
    count = copies_for(sum(stored_bytes(s) for s in layer), layers, footprint)
    cycle = Cycle([layer] + [[_clone(s) for s in layer] for _ in range(count - 1)])
    xs = [torch.randn(shapes.rows, k, generator=gen).to(dtype) for _, k in shapes.dense]

    def run() -> None:
        for x, w in zip(xs, cycle.next(), strict=True):
            lin(x, w)

    return run, count, sum(stored_bytes(s) for s in layer)


def _clone(stored: Any) -> Any:
    return tuple(t.clone() for t in stored) if isinstance(stored, tuple) else stored.clone()


def experts_runner(
    shapes: Shapes,
    method: tuple[torch.dtype, Callable[..., Any], Linear],
    layers: int,
    footprint: int,
) -> tuple[Callable[[], None], int, int]:
    """A layer's touched experts (gate_up, GeGLU, down on each expert's rows) by `method`,
    cycling through distinct expert weights; how many distinct experts it holds; the weight
    bytes one call reads."""
    dtype, store, lin = method
    gen = torch.Generator().manual_seed(1)
    h, i = shapes.hidden, shapes.inter
    one = [store(torch.randn(2 * i, h, generator=gen) / math.sqrt(h))]
    one.append(store(torch.randn(h, i, generator=gen) / math.sqrt(i)))
    per_layer = stored_bytes(one[0]) + stored_bytes(one[1])
    count = copies_for(per_layer, layers * shapes.experts, footprint)
    cycle = Cycle([one] + [[_clone(s) for s in one] for _ in range(count - 1)])
    x = torch.randn(shapes.expert_rows, h, generator=gen).to(dtype)

    def run() -> None:
        for _ in range(shapes.touched):
            gate_up, down = cycle.next()
            gate, up = lin(x, gate_up).chunk(2, -1)
            lin(F.gelu(gate, approximate="tanh") * up, down)

    return run, count, per_layer * shapes.touched


def native_experts(shapes: Shapes, dtype: torch.dtype, packs: PackedWeights) -> Callable[[], None]:
    """Canvas' native experts (`moe.fused_moe`) of one layer at one canvas, uniform routing."""
    gen = torch.Generator().manual_seed(2)
    e, h, i = shapes.experts, shapes.hidden, shapes.inter
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / math.sqrt(h)).to(dtype)
    down = (torch.randn(e, h, i, generator=gen) / math.sqrt(i)).to(dtype)
    x = torch.randn(shapes.rows, h, generator=gen).to(dtype)
    slots = torch.arange(shapes.rows * shapes.top_k) % e
    ids = slots.view(shapes.rows, shapes.top_k)
    weights = torch.full((shapes.rows, shapes.top_k), 1 / shapes.top_k, dtype=torch.float32)
    return lambda: moe.fused_moe(x, gate_up, down, weights, ids, None, packs)


def medians(
    runs: dict[str, Callable[[], None]], rounds: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Each run's (median, fastest) seconds over `rounds`, all runs once per round, after
    `warmup` (the fastest: what a run costs with the least interference from the machine's
    other work)."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    return {label: (statistics.median(ts), min(ts)) for label, ts in times.items()}


def table(title: str, times: dict[str, tuple[float, float]], notes: dict[str, str]) -> None:
    """One line per method: median and fastest ms, and the fastest baseline's / its (each)."""
    med = min(times[b][0] for b in BASELINES if b in times)
    low = min(times[b][1] for b in BASELINES if b in times)
    print(f"  {title}{'median ms':>{40 - len(title)}} {'fastest':>9} {'ratios':>13}")
    for label, (m, f) in times.items():
        cells = f"{1e3 * m:>10.2f} {1e3 * f:>9.2f} {med / m:>6.2f}x {low / f:>5.2f}x"
        print(f"    {label:>14}{cells:>{48 - 18}}  {notes.get(label, '')}")


def layer_times(
    shapes: Shapes, args: argparse.Namespace, layers: int, native: bool
) -> tuple[dict[str, tuple[float, float]], dict[str, tuple[float, float]]]:
    """Print and return the dense and experts (median, fastest) of one layer of `shapes`."""
    packs, footprint = PackedWeights(), args.footprint_mb << 20
    chosen = {
        label: m
        for label, m in methods(packs, shapes.rows).items()
        if label != "int8 f32" or shapes.rows <= INT8_F32_MAX_ROWS
    }
    print(
        f"{shapes.name}: {shapes.rows} rows, {shapes.touched} experts x {shapes.expert_rows} rows"
    )
    runs, sizes = {}, {}
    for label, m in chosen.items():
        runs[label], count, read = dense_runner(shapes, m, layers, footprint)
        sizes[label] = (f"{count} layer copies", read)
    dense = medians(runs, args.rounds, args.warmup)
    table("dense projections of one layer", dense, rates(dense, sizes))
    del runs
    runs, sizes = {}, {}
    if native:
        for label, dtype in (("fp32 native", torch.float32), ("bf16 native", torch.bfloat16)):
            runs[label] = native_experts(shapes, dtype, packs)
    for label, m in chosen.items():
        runs[label], count, read = experts_runner(shapes, m, layers, footprint)
        sizes[label] = (f"{count} distinct experts", read)
    experts = medians(runs, args.rounds, args.warmup)
    table("experts of one layer", experts, rates(experts, sizes))
    return dense, experts


def rates(
    times: dict[str, tuple[float, float]], sizes: dict[str, tuple[str, int]]
) -> dict[str, str]:
    """Each method's note: its copies and the weight bytes it read per second (median)."""
    return {
        label: f"({what}; weights read at {read / times[label][0] / 1e9:.1f} GB/s)"
        for label, (what, read) in sizes.items()
    }


def read_rate(footprint: int, rounds: int) -> float:
    """Bytes per second one `sum` streams from `footprint` bytes (the memory's read rate, the
    ceiling a memory-bound projection would run at); the fastest of `rounds`."""
    data = torch.ones(footprint // 8, dtype=torch.int64)
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return footprint / best


def forward_estimate(
    path: Path,
    args: argparse.Namespace,
    dense: dict[str, tuple[float, float]],
    experts: dict[str, tuple[float, float]],
) -> None:
    """Time one forward of the checkpoint at `path` (a bench preset's) at one canvas in fp32 and
    bf16 (native kernels) and print
    the forward int8 would give, from the medians and from the fastest rounds: the faster
    forward with its layers' dense projections (then also its experts) swapped for the fastest
    int8 method's, the rest unchanged."""
    steps = {}
    for label, dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        model = open_checkpoint(CheckpointConfig(path, dtype, "cpu", kernels="native")).model
        steps[label] = Step(model, 1)
    forward = medians({k: s.run for k, s in steps.items()}, args.rounds, args.warmup)
    layers = model.cfg.num_layers
    print(f"  forward at one canvas, with the logits{'median ms':>11} {'fastest':>9}")
    for label, (m, f) in forward.items():
        print(f"    {label:>14}{1e3 * m:>20.2f} {1e3 * f:>9.2f}")
    for stat, which in ((0, "medians"), (1, "fastest")):
        best = min(forward, key=lambda k: forward[k][stat])
        int8 = min(("int8", "int8>bf16"), key=lambda k: dense[k][stat])
        whole, native = forward[best][stat], f"{best} native"
        swap_dense = whole - layers * (dense[best][stat] - dense[int8][stat])
        swap_all = swap_dense - layers * (experts[native][stat] - experts[int8][stat])
        share = layers * (dense[best][stat] + experts[native][stat]) / whole
        if share >= 1:
            print(f"    {which}: the layers' times exceed the forward's (noise): no estimate")
            continue
        print(
            f"    {which}: {best} fastest; its dense + experts x {layers} layers = {share:.0%} "
            f"of it; with {int8} dense est. {whole / swap_dense:.2f}x, dense + experts "
            f"{whole / swap_all:.2f}x"
        )


def l3_line() -> str:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        size = "?"
    return f"L3 {size}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--footprint-mb", type=int, default=600, help="real shapes' weights")
    parser.add_argument(
        "--rows", type=int, default=0, help="rows instead of a canvas (1: an AR step), no forward"
    )
    parser.add_argument(
        "--only",
        choices=("bench-tiny", "bench-small", "real"),
        nargs="+",
        default=["bench-tiny", "bench-small", "real"],
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.footprint_mb < 1 or args.rows < 0:
        parser.error("--rounds and --footprint-mb must be >= 1, --warmup and --rows >= 0")
    torch.set_grad_enabled(False)
    print("command:", " ".join([sys.executable, "-m", "loadtest.cpu.int8_bench", *sys.argv[1:]]))
    features = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni", "amx_int8")]
    have = [f for f in features if f in build.cpu_flags()]
    name = next((ln for ln in build.machine().splitlines() if ln.startswith("model")), "?")
    print(
        f"cpu: {name.partition(':')[2].strip()}; {', '.join(have)}; {l3_line()}; "
        f"oneDNN AMX {bf16.onednn_amx()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.rounds} rounds, medians"
    )
    rate = read_rate(args.footprint_mb << 20, 5)
    print(f"memory: one sum streams {args.footprint_mb} MB at {rate / 1e9:.1f} GB/s")
    for preset in args.only:
        if preset == "real":
            rows = args.rows or REAL_26B_A4B_CANVAS_LENGTH
            shapes = shapes_of("real 26B-A4B", REAL_26B_A4B_TEXT_CONFIG, rows)
            layer_times(shapes, args, 0, native=False)
            continue
        text = preset_text_config(preset)
        shapes = shapes_of(preset, text, args.rows or PRESETS[preset].canvas_length)
        dense, experts = layer_times(shapes, args, text["num_hidden_layers"], native=True)
        if not args.rows:
            with tempfile.TemporaryDirectory() as tmp:
                forward_estimate(make_tiny(Path(tmp) / preset, preset), args, dense, experts)
    print("(each line: median ms of one layer, and the fastest of Canvas' fp32/bf16 / its)")


if __name__ == "__main__":
    main()
