"""GPU speed without a GPU: the engine's real step at the real DiffusionGemma 26B-A4B shapes,
run on the meta device through the custom ops (`KernelSet.with_custom_ops`), every op
recorded by `loadtest.gpu.accountant` and its time predicted on an H200 and an H100 SXM.

    python -m loadtest.gpu.roofline [--canvases 1 4 16 64] [--layers N] [--top 8]   (make roofline)
        [--quantization fp8]   (FP8 projections and experts, as `--quantization fp8` loads them,
                                on sm_90's FP8 rows; `--without-fp8-rows`: each quantizes its own)
        [--cuda-graphs]        (all-denoise and all-AR steps replay what `--cuda-graphs`
                                captures: the forward, and at <= HEAD_ROWS canvases the head
                                and sampler, at <= HEAD_ROWS AR rows the head)
        [--launch-us US]       (every launch costs US µs; 0: none, the whole step captured)
    python -m loadtest.gpu.roofline --measured-launch   (launch cost measured here: launch_probe)
    python -m loadtest.gpu.roofline_calibrate     (the accountant against a measured CPU step)

Step kinds (prefix PREFIX_LEN tokens per row): `denoise` (R canvases, head and sampler),
`commit` (R commit passes of a canvas beside the R next canvases' first steps), `prefill`
(R prompt chunks of PREFILL_CHUNK tokens, no head) and `ar` (R one-token rows, head and
AR sampler). Phases: inputs (host-made tensors moved, the canvas inputs), forward (model and
head), sampler, publish (the step's one device-to-host copy).

The floor of a step is the larger of streaming its weights once (the experts its tokens touch)
and its GEMM FLOPs at the tensor-core peak. The report also counts the steps' host-to-device
copies from pageable memory (per phase; the goal is none) and compares a denoise step's
inputs-phase host work at two context lengths (`--contexts`; the goal is no growth).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.batched_sampler import BatchedSampler, to_host
from engine.device.cuda import to_device
from engine.device.memory import meta_model
from engine.device.sampler_graphs import SamplerGraphs
from engine.device.step_buffers import SamplerInputs
from engine.kv_pages import PageTables
from engine.model import DiffusionLM
from engine.model.config import LayerType, ModelConfig
from engine.model.kv_cache import PagedKVCache
from engine.model.quant import QUANTIZATION_CHOICES
from engine.runner import EncodeInput, ModelRunner, StepInputs
from kernels import KernelSet, resolve_kernels
from loadtest.gpu.accountant import GPUS, Accountant, Hardware, OpRecord, StepRows
from loadtest.gpu.bench import build_model, model_config
from loadtest.gpu.custom_rules import touched_experts
from loadtest.gpu.launch_probe import LaunchCost, measure
from loadtest.gpu.meta_graphs import MetaCapture, active_accountant

KINDS = ("denoise", "commit", "prefill", "ar")
PREFIX_LEN = 1024
PREFILL_CHUNK = 512
PAGE_SIZE = 16
# The sampler's and publish's syncs that a fast-numerics step may have: the one transfer of
# its results to the host (`batched_sampler.to_host`), after the sampler.
ALLOWED_SYNC_PHASES = ("inputs", "publish")


@dataclass(slots=True)
class StepAccount:
    kind: str
    canvases: int
    acct: Accountant
    weight_bytes: float
    # The step replayed what `--cuda-graphs` captures (`MetaCapture`): each graph one launch,
    # the kernels inside none (`OpRecord.captured`), everything else launched as it is.
    graphs: bool = False

    def op_seconds(self, record: OpRecord, hw: Hardware) -> float:
        return record.seconds(hw)

    def seconds(self, hw: Hardware) -> float:
        return sum(self.op_seconds(r, hw) for r in self.acct.records)


def with_layers(config: ModelConfig, num_layers: int | None) -> ModelConfig:
    """The config with its first `num_layers` layers (a quick dry run), or as is."""
    if num_layers is None:
        return config
    layers = config.text.layers[:num_layers]
    text = replace(config.text, layers=layers, num_layers=num_layers)
    return replace(config, text=text)


def build(
    config: ModelConfig, kernels: KernelSet, device: torch.device, quantization: str = "auto"
) -> DiffusionLM:
    """The model on the meta device, bf16 (its projections and experts FP8 with `quantization`
    "fp8"), with `kernels` bound."""
    model = meta_model(config, torch.bfloat16, quantization)
    model.init_rope(device)
    model.bind_kernels(kernels)
    return model


def _pages(row: int, per_row: int) -> PageTables:
    pages = list(range(row * per_row, (row + 1) * per_row))
    return PageTables(full=pages, ring=list(pages), num_logical=per_row)


def pages_per_row(canvas: int, prefix: int = PREFIX_LEN) -> int:
    return math.ceil((prefix + 2 * canvas + PREFILL_CHUNK) / PAGE_SIZE)


def step_rows(
    kind: str, canvases: int, canvas: int, prefix: int = PREFIX_LEN
) -> tuple[list[int], list[EncodeInput]]:
    """(starts of the DENOISE rows, the ENCODE rows) of a step kind, each row's context
    `prefix` tokens; the DENOISE rows' pages are `_pages` of their index."""
    per_row = pages_per_row(canvas, prefix)
    denoise, encode = [], []
    for r in range(canvases):
        pages = _pages(r, per_row)
        if kind == "denoise":
            denoise.append(prefix)
        elif kind == "commit":  # the commit pass, and the next canvas's first step after it
            encode.append(EncodeInput(prefix, [5] * canvas, pages, False))
            denoise.append(prefix + canvas)
        elif kind == "prefill":
            encode.append(EncodeInput(prefix, [5] * PREFILL_CHUNK, pages, False))
        else:
            encode.append(EncodeInput(prefix, [5], pages, True))
    return denoise, encode


class StepHarness:
    """One step of `kind` over `canvases` rows of `prefix` tokens of context as the engine runs
    it (fast numerics): its KV pools, runner and sampler built once, `run` repeatable (a
    calibration times it). The rows' sequences are already running: the runner's device page
    tables hold their tables (written when a sequence joins or its tables change)."""

    def __init__(
        self,
        model: DiffusionLM,
        kind: str,
        canvases: int,
        device: torch.device,
        prefix: int = PREFIX_LEN,
        graphs: bool = False,
    ) -> None:
        """`graphs`: all-denoise and all-AR steps replay the graphs `--cuda-graphs` captures
        (on the meta device: `MetaCapture`)."""
        config, self.canvas = model.config, model.config.canvas_length
        self.kind, self.device = kind, device
        self.starts, self.encode = step_rows(kind, canvases, self.canvas, prefix)
        self.per_row = pages_per_row(self.canvas, prefix)
        cache = PagedKVCache(
            config.text, dict.fromkeys(LayerType, canvases * self.per_row), PAGE_SIZE,
            model.embed_tokens.weight.dtype, device,
        )  # fmt: skip
        self.pages = [_pages(r, self.per_row) for r in range(len(self.starts))]
        held = self.pages + [e.pages for e in self.encode]
        capture = MetaCapture() if graphs else None
        self.runner = ModelRunner(model, cache, max_rows=len(held), graphs=capture)
        self.runner.tables.gather(held)
        embed = model.embed_tokens.weight
        scale = float(model.embed_scale)
        self.sampler = BatchedSampler(model.kernels, embed, scale, self.canvas, canvases)
        self.staged = SamplerInputs(device, canvases)
        forward = self.runner.graphs  # as `engine.sampling.BatchedSampling` samples
        self.steps = SamplerGraphs(forward, self.sampler, self.staged) if forward else self.sampler
        rows = [(s, self.canvas, True) for s in self.starts]
        self.rows = StepRows(rows + [(e.start, len(e.tokens), False) for e in self.encode])

    def run(self, acct: Accountant | None = None) -> None:
        if acct is None:
            self._run(lambda name: contextlib.nullcontext())
            return
        acct.rows = self.rows
        with acct:
            self._run(acct.phase)

    def _run(self, phase: Callable[[str], contextlib.AbstractContextManager[None]]) -> None:
        device, starts, encode, sampler = self.device, self.starts, self.encode, self.sampler
        if encode:  # an AR step's tokens and positions are new every step: no batch is reused
            self.runner.tables.place([])
        with phase("inputs"):
            inputs = StepInputs(starts, self.pages, None, [], encode)
            rows = None
            if starts:  # as engine.sampling.BatchedSampling builds them
                num = len(starts)
                slots, flags = self.staged.stage(list(range(num)), [self.kind == "commit"] * num)
                ids, soft, rows = self.steps.canvas_inputs(slots, flags)
                inputs = replace(inputs, canvas_ids=ids, soft_embeds=soft)
        with phase("forward"):
            out = self.runner.execute(inputs)
        with phase("sampler"):
            parts: list[torch.Tensor] = []
            if rows is not None and out.denoise_logits is not None:
                new, parts = self.steps.denoise(out.denoise_logits, rows)
                self.steps.write(new)
            if out.last_logits is not None:  # as engine.sampling.BatchedSampling builds them
                slots = to_device(np.arange(len(encode), dtype=np.int64), device)
                index = to_device(np.full(len(encode), 7, dtype=np.int64), device)
                parts += sampler.sample_ar(out.last_logits, slots, index)
        with phase("publish"):
            try:
                to_host(parts)
            except NotImplementedError as exc:  # `.tolist()` of a meta tensor: the D2H copy
                if "meta" not in str(exc):
                    raise
                phase_acct = active_accountant()
                if phase_acct is not None:
                    phase_acct.sync("to_host", "device to host copy")


def launch_backends() -> tuple[str, ...]:
    """The kernels the launch probe times here: the engine's on a GPU (Triton); on a CPU the
    twins, then the engine's default (the native kernels where this machine builds them)."""
    return ("auto",) if torch.cuda.is_available() else ("twins", "auto")


def measured_launch(backend: str, prefix: int = 64) -> LaunchCost:
    """The launch-cost probe on this machine's device (a GPU where there is one) with
    `backend`: a denoise step of one canvas, the toy stack through its first full layer."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(toy=True)
    full = next(i for i, spec in enumerate(config.text.layers) if not spec.is_sliding)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(with_layers(config, full + 1), device, dtype, backend)
    with torch.inference_mode():  # a harness per step: its sampler takes the kernels bound
        return measure(model, lambda: StepHarness(model, "denoise", 1, device, prefix).run())


def weight_bytes(model: DiffusionLM, num_tokens: int) -> float:
    """What streaming the step's weights once moves: every parameter but the experts, and the
    experts its `num_tokens` tokens touch (uniform routing)."""
    cfg = model.cfg
    share = touched_experts(num_tokens, cfg.num_experts, cfg.top_k_experts) / cfg.num_experts
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size * share if ".experts." in name else size
    return total


def account(
    model: DiffusionLM, kind: str, canvases: int, prefix: int = PREFIX_LEN, graphs: bool = False
) -> StepAccount:
    meta = torch.device("meta")
    acct = Accountant("meta")
    with torch.inference_mode():
        harness = StepHarness(model, kind, canvases, meta, prefix, graphs)
        if graphs:  # the first step captures, the accounted one replays
            harness.run()
        harness.run(acct)
    num_tokens = sum(n for _, n, _ in acct.rows.rows)
    return StepAccount(kind, canvases, acct, weight_bytes(model, num_tokens), graphs)


@dataclass(frozen=True, slots=True)
class InputsWork:
    """The host work of a step's inputs phase (`Accountant.host_work`) at one context length,
    and the page-table rows the runner wrote on the host for it."""

    prefix: int
    ops: int
    host_bytes: float
    rows_written: int


def inputs_work(model: DiffusionLM, kind: str, canvases: int, prefix: int) -> InputsWork:
    meta = torch.device("meta")
    acct = Accountant("meta")
    with torch.inference_mode():
        harness = StepHarness(model, kind, canvases, meta, prefix)
        written = harness.runner.tables.rows_written
        harness.run(acct)
    ops, host_bytes = acct.host_work("inputs")
    return InputsWork(prefix, ops, host_bytes, harness.runner.tables.rows_written - written)


# -- reports ---------------------------------------------------------------------------------


def floor_s(step: StepAccount, hw: Hardware) -> float:
    return max(step.weight_bytes / hw.bandwidth, step.acct.gemm_flops / hw.tensor_flops)


def summary_table(steps: list[StepAccount], gpus: tuple[Hardware, ...] = GPUS) -> str:
    head = (
        "| step | canvases | "
        + " | ".join(f"{hw.name} ms | floor ms | ×floor" for hw in gpus)
        + " | launches (in graphs) | syncs (fwd+sampler) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in steps:
        cells = []
        for hw in gpus:
            t, f = s.seconds(hw), floor_s(s, hw)
            cells.append(f"{t * 1e3:.2f} | {f * 1e3:.2f} | {t / f:.2f}")
        inner = len(s.acct.syncs(("forward", "sampler")))
        lines.append(
            f"| {s.kind} | {s.canvases} | " + " | ".join(cells)
            + f" | {s.acct.launches} ({s.acct.captured_launches})"
            + f" | {len(s.acct.syncs())} ({inner}) |"
        )  # fmt: skip
    return "\n".join(lines)


def top_ops(step: StepAccount, hw: Hardware, top: int) -> str:
    groups: dict[str, list[OpRecord]] = defaultdict(list)
    for r in step.acct.records:
        groups[f"{r.phase}: {r.name}"].append(r)
    rows = sorted(groups.items(), key=lambda kv: -sum(step.op_seconds(r, hw) for r in kv[1]))
    total = step.seconds(hw)
    lines = [
        f"Top ops, {step.kind} at {step.canvases} canvases on {hw.name} ({total * 1e3:.1f} ms):",
        "| op | calls | launches | GB | TFLOP | ms | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, recs in rows[:top]:
        t = sum(step.op_seconds(r, hw) for r in recs)
        lines.append(
            f"| {name} | {len(recs)} | {sum(r.host_launches for r in recs)} "
            f"| {sum(r.bytes for r in recs) / 1e9:.2f} | {sum(r.flops for r in recs) / 1e12:.2f} "
            f"| {t * 1e3:.2f} | {t / total:.0%} |"
        )
    return "\n".join(lines)


def sync_table(step: StepAccount) -> str:
    where: dict[tuple[str, str, str], int] = defaultdict(int)
    for r in step.acct.syncs():
        where[(r.phase, r.sync, r.where)] += 1
    lines = [f"Syncs, {step.kind} at {step.canvases} canvases:", "| phase | kind | where | n |"]
    lines.append("|---|---|---|---|")
    lines += [f"| {p} | {k} | {w} | {n} |" for (p, k, w), n in sorted(where.items())]
    return "\n".join(lines)


def copies_line(steps: list[StepAccount]) -> str:
    """The steps' host-to-device copies by source memory, the pageable ones per phase."""
    pinned = sum(sum(r.copy == "pinned" for r in s.acct.records) for s in steps)
    pageable = [r for s in steps for r in s.acct.pageable_copies()]
    phases = ", ".join(
        f"{p} {sum(r.phase == p for r in pageable)}"
        for p in ("inputs", "forward", "sampler", "publish")
    )
    size = sum(r.host_bytes for r in pageable)
    line = (
        f"Host-to-device copies over {len(steps)} steps: {pinned} from pinned memory, "
        f"{len(pageable)} from pageable memory ({phases}; {size:,.0f} B)"
    )
    where: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in pageable:
        where[(r.phase, r.where)].append(r.host_bytes)
    rows = [f"| {p} | {w} | {len(b)} | {sum(b):,.0f} |" for (p, w), b in sorted(where.items())]
    table = ["", "| phase | where | pageable copies | bytes |", "|---|---|---|---|", *rows]
    return line + ("\n".join(table) if rows else "")


def context_line(kind: str, canvases: int, work: list[InputsWork]) -> str:
    """Whether the inputs phase's host work stays the same as the context grows."""
    cells = "; ".join(
        f"{w.prefix:,}-token context: {w.ops} ops, {w.host_bytes:,.0f} B, "
        f"{w.rows_written} page-table rows written"
        for w in work
    )
    same = len({(w.ops, w.host_bytes, w.rows_written) for w in work}) == 1
    verdict = "independent of context" if same else "GROWS with context"
    return f"Inputs-phase host work, {kind} at {canvases} canvases: {cells}: {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--canvases", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--layers", type=int, default=None, help="only the first N layers")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[2048, 32768],
        help="context lengths of the inputs-phase host work check",
    )  # fmt: skip
    parser.add_argument("--context-canvases", type=int, default=16)
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_CHOICES, default="auto",
        help="fp8: FP8 projections and experts (the Triton FP8 kernels' bytes); auto: bf16",
    )  # fmt: skip
    parser.add_argument(
        "--without-fp8-rows", action="store_true",
        help="fp8: each projection and the experts quantize their own input (no FP8 rows)",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="all-denoise and all-AR steps replay what --cuda-graphs captures (a graph: one "
        "launch)",
    )  # fmt: skip
    parser.add_argument(
        "--measured-launch", action="store_true",
        help="predict with the launch cost this machine measures (loadtest.gpu.launch_probe)",
    )  # fmt: skip
    parser.add_argument(
        "--launch-us", type=float, default=None,
        help="every kernel launch's cost in µs (default: the hardware's; 0: launches free)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    gpus = GPUS
    if args.launch_us is not None:
        if args.launch_us < 0 or args.measured_launch:
            parser.error("--launch-us must be >= 0 and cannot go with --measured-launch")
        gpus = tuple(hw.with_launch(args.launch_us * 1e-6) for hw in GPUS)
    if args.measured_launch:
        costs = [measured_launch(backend) for backend in launch_backends()]
        print("".join(f"Launch cost measured: {c.line()}\n" for c in costs))
        gpus = tuple(hw.with_launch(costs[-1].per_call_s) for hw in GPUS)
    config = with_layers(model_config(), args.layers)
    kernels = resolve_kernels("cpu", "twins")
    fp8_rows = args.quantization == "fp8" and not args.without_fp8_rows
    kernels = (kernels.with_fp8_rows() if fp8_rows else kernels).with_custom_ops()
    model = build(config, kernels, torch.device("meta"), args.quantization)
    weights = "FP8 projections and experts" if args.quantization == "fp8" else "bf16"
    weights += " on FP8 rows" if fp8_rows else ""
    numerics = "fast numerics" + (
        ", CUDA graphs (what --cuda-graphs captures replayed)" if args.cuda_graphs else ""
    )
    began = time.perf_counter()
    steps = [
        account(model, k, r, graphs=args.cuda_graphs) for k in args.kinds for r in args.canvases
    ]
    print(
        f"# Roofline: DiffusionGemma 26B-A4B, {config.text.num_layers} layers, {weights}, "
        f"prefix {PREFIX_LEN}, {numerics} ({time.perf_counter() - began:.1f} s on meta)\n"
    )
    print("Peaks: " + "; ".join(
        f"{h.name} {h.tensor_flops / 1e12:.0f} TFLOP/s bf16, {h.fp32_flops / 1e12:.0f} fp32, "
        f"{h.bandwidth / 1e12:.2f} TB/s, {h.launch_s * 1e6:.0f} µs/launch, "
        f"{h.sync_s * 1e6:.0f} µs/sync" for h in gpus) + "\n")  # fmt: skip
    print(summary_table(steps, gpus) + "\n")
    print(copies_line(steps) + "\n")
    work = [inputs_work(model, "denoise", args.context_canvases, n) for n in args.contexts]
    print(context_line("denoise", args.context_canvases, work) + "\n")
    for s in steps:
        if s.canvases == max(args.canvases) or s.canvases == 16:
            print(top_ops(s, gpus[0], args.top) + "\n")
    for s in steps:
        if s.canvases == min(args.canvases):
            print(sync_table(s) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
