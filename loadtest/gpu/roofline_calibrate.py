"""The roofline's accountant checked against a step it can measure: the CPU. The same step
harness as `loadtest.gpu.roofline` runs the `bench-small` stack (engine.checkpoints.tiny: the real
layer pattern and MoE scaled to ~32M parameters) in fp32 on the CPU with the fast twins; the
accountant predicts its time from this machine's rates, measured here (an fp32 GEMM, a copy,
a tiny op's dispatch cost), and the step is then timed (warmed, median of repeats).

    python -m loadtest.gpu.roofline_calibrate
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.checkpoints.tiny import PRESETS, preset_text_config
from engine.model.config import ModelConfig, parse_text_config
from kernels import resolve_kernels
from loadtest.gpu.accountant import Accountant, Hardware, sdpa_flops
from loadtest.gpu.bench import meta_model
from loadtest.gpu.roofline import StepHarness

PRESET = "bench-small"
CANVASES = (4, 16)


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def measure_cpu() -> Hardware:
    """This CPU's fp32 GEMM rate (1024^3), memory bandwidth (a 256 MiB copy: read + write),
    per-op cost (a 16-element add) and attention rate (`sdpa_rate`), each the best of a few
    runs."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    gemm = 2 * 1024**3 / _best(lambda: a @ b, 5)
    src = torch.empty(64 << 20)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), 5)
    tiny = torch.zeros(16)
    per_op = _best(lambda: [tiny.add_(1) for _ in range(1000)], 3) / 1000
    return Hardware("this CPU", gemm, gemm, bandwidth, per_op, 0.0, sdpa_rate())


def sdpa_rate(preset: str = PRESET, rows: int = 16) -> float:
    """FLOP/s of one fp32 SDPA call as the attention twin makes it at `preset`'s shapes:
    `rows` canvases of its canvas length over a prefix of as many keys again, GQA, with a
    boolean mask (FLOPs as the accountant counts them, `sdpa_flops`)."""
    cfg = preset_text_config(preset)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim, length = cfg["head_dim"], PRESETS[preset].canvas_length
    q = torch.randn(rows, heads, length, dim)
    k = torch.randn(rows, kv_heads, 2 * length, dim)
    v = torch.randn_like(k)
    mask = torch.ones(rows, 1, length, 2 * length, dtype=torch.bool).tril(length)

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return sdpa_flops(q, k) / _best(call, 5)


def cpu_model(preset: str = PRESET) -> torch.nn.Module:
    text = parse_text_config(preset_text_config(preset))
    config = ModelConfig("diffusion_gemma", text, PRESETS[preset].canvas_length, "float32")
    model = meta_model(config, torch.float32).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.fill_(1.0)
    model.init_rope("cpu")
    model.bind_kernels(resolve_kernels("cpu"))
    return model


def calibrate(kinds: tuple[str, ...] = ("denoise", "commit"), repeats: int = 3) -> str:
    """One thread: a shared 2-core VM slows multi-threaded ops erratically (cpu-facts.md)."""

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hw = measure_cpu()
    model = cpu_model()
    cpu = torch.device("cpu")
    lines = [
        f"Calibration on this CPU ({torch.get_num_threads()} threads): fp32 GEMM "
        f"{hw.tensor_flops / 1e9:.0f} GFLOP/s, fp32 SDPA {hw.attention_flops / 1e9:.1f} GFLOP/s, "
        f"copy {hw.bandwidth / 1e9:.1f} GB/s, "
        f"{hw.launch_s * 1e6:.1f} µs per op; {PRESET}, fp32, fast twins\n",
        "| step | canvases | ops | predicted ms | ops' own ms | measured ms | predicted / measured "
        "|",
        "|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for kind in kinds:
            for canvases in CANVASES:
                harness = StepHarness(model, kind, canvases, cpu)  # type: ignore[arg-type]
                acct = Accountant("cpu")
                harness.run(acct)
                predicted = acct.seconds(hw)
                harness.run()  # warm
                times = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    harness.run()
                    times.append(time.perf_counter() - began)
                measured = statistics.median(times)
                lines.append(
                    f"| {kind} | {canvases} | {len(acct.records)} | {predicted * 1e3:.1f} "
                    f"| {sum(r.wall_s for r in acct.records) * 1e3:.1f} "
                    f"| {measured * 1e3:.1f} | {predicted / measured:.2f} |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    print(calibrate())
