"""One denoising forward of `bench-small` in fp32 and bf16, native kernels and twins, side by side.

    OMP_NUM_THREADS=2 python -m loadtest.cpu.dtype_bench [--canvases 1 16] [--rounds 7]

For each canvas count: every sequence's 64-token prompt prefilled once, then one forward of all
the canvases (decode rows of the checkpoint's canvas length, the hidden states through the
logits) timed for each model: fp32 on the native kernels, bf16 on the native kernels, bf16 on
the twins. Each is warmed at the shape it is timed at; then the models run one after another in
every round (neighbouring runs: this VM's speed drifts between minutes) and each model's median
over the rounds is reported with the ratios against fp32 native. Prints the command, the CPU
and its bf16 features, and torch's thread count beside the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.build import CheckpointConfig, open_checkpoint
from engine.checkpoints.tiny import make_tiny
from engine.kv_pages import KVPages, PageGeometry
from engine.model import DiffusionLM, ForwardBatch, Mode, PagedKVCache, Row
from engine.model.config import LayerType
from kernels.native import bf16, build

PAGE = 16
PROMPT = 64
# (label, dtype, kernels), fp32 native first: the ratios' denominator.
MODELS = (
    ("fp32 native", "float32", "native"),
    ("bf16 native", "bfloat16", "native"),
    ("bf16 twins", "bfloat16", "twins"),
)


class Step:
    """One model's canvases over prefilled prompts: `run()` is one denoising forward."""

    def __init__(self, model: DiffusionLM, canvases: int, seed: int = 0) -> None:
        cfg, length = model.cfg, model.config.canvas_length
        context = PROMPT + length
        geometry = PageGeometry(PAGE, cfg.sliding_window, context, True, True)
        full, ring = geometry.full_pages(context), geometry.sliding_ring(context)
        pages = KVPages(geometry, full * canvases, ring * canvases)
        tables = [pages.allocate(context) for _ in range(canvases)]
        sizes = {LayerType.FULL: full * canvases, LayerType.SLIDING: ring * canvases}
        self.cache = PagedKVCache(cfg, sizes, PAGE, model.embed_tokens.weight.dtype)
        self.model = model

        def rows(mode: Mode, start: int, num: int) -> list[Row]:
            return [
                Row(mode, start, num, {LayerType.FULL: t.full, LayerType.SLIDING: t.sliding()})
                for t in tables
            ]

        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, cfg.vocab_size, (canvases * PROMPT,), generator=g)
        self.forward(rows(Mode.ENCODE, 0, PROMPT), prompts)
        self.rows = rows(Mode.DECODE, PROMPT, length)
        self.ids = torch.randint(0, cfg.vocab_size, (canvases * length,), generator=g)

    def forward(self, rows: list[Row], ids: torch.Tensor) -> torch.Tensor:
        batch = ForwardBatch(rows, self.model.cfg.sliding_window, PAGE)
        soft = [None] * sum(r.mode is Mode.DECODE for r in rows)
        return self.model(ids, soft, batch, self.cache)

    def run(self) -> None:
        self.model.logits(self.forward(self.rows, self.ids))


def time_steps(steps: dict[str, Step], rounds: int, warmup: int) -> dict[str, float]:
    """Each step's median seconds over `rounds`, all steps once per round, after `warmup`."""
    for step in steps.values():
        for _ in range(warmup):
            step.run()
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            step.run()
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(ts) for label, ts in times.items()}


def cpu_line() -> str:
    info = build.machine().splitlines()
    name = next((ln.partition(":")[2].strip() for ln in info if ln.startswith("model")), "?")
    features = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in build.cpu_flags()]
    return f"{name}; {', '.join(features) or 'no bf16 features'}; bf16 paths {bf16.paths()}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canvases", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, help="a bench-small directory (built if absent)")
    args = parser.parse_args(argv)
    if min(args.canvases) < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--canvases and --rounds must be >= 1, --warmup >= 0")
    print("command:", " ".join([sys.executable, "-m", "loadtest.cpu.dtype_bench", *sys.argv[1:]]))
    print(f"cpu: {cpu_line()}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or Path(tmp) / "bench-small"
        if not (path / "config.json").is_file():
            make_tiny(path, "bench-small")
        torch.set_grad_enabled(False)
        models = {
            label: open_checkpoint(CheckpointConfig(path, dtype, "cpu", kernels=k)).model
            for label, dtype, k in MODELS
        }
        print(f"{'canvases':>8} " + " ".join(f"{label:>14}" for label in models) + "  (ms)")
        for canvases in args.canvases:
            steps = {label: Step(model, canvases) for label, model in models.items()}
            medians = time_steps(steps, args.rounds, args.warmup)
            base = medians[MODELS[0][0]]
            cells = " ".join(f"{1e3 * t:>8.1f} {base / t:>4.2f}x" for t in medians.values())
            print(f"{canvases:>8} {cells}")
    print("(each cell: median ms of one forward with the logits, and fp32 native's time / its)")


if __name__ == "__main__":
    main()
