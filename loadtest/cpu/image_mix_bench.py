"""Image requests mixed with text-only ones: what they cost the text-only requests' latency.

Through the engine (offline, no HTTP): text-only requests arrive every `--text-gap` steps; in
the mixed run, image requests (one fresh image each, so the vision tower runs for every one)
arrive every `--image-gap` steps among them. A text request's latency is the wall time from the
start of the step it arrived at to the end of the step that finished it. Three workloads:

- alone: the text requests only;
- mixed: the text requests and the image requests;
- control: the text requests and text-only stand-ins for the image requests (the same prompt
  lengths, plain tokens): what the same amount of extra work costs without images, so
  mixed / control is the images' own cost (vision tower, image masks, chunks cut at images).

Every workload runs once as warm-up, then `--repeats` times (the prefix cache reset before
each run; prompts are random, so nothing is shared anyway); the report gives each run's mean
text latency, the median over runs, and the ratios of medians. Diffusion mode with a fixed
number of denoising steps and no EOS (random weights never converge), so every request
writes `--max-tokens`. On a tiny checkpoint by default
(`canvas make-tiny --vision`, built into a temporary directory), or `--model DIR`.

    python -m loadtest.cpu.image_mix_bench [--model DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.inputs.images import ImageProcessor, PreparedImage


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int  # the step it is added before
    ids: list[int]
    images: tuple[PreparedImage, ...]
    text: bool  # a measured text-only request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.cpu.image_mix_bench", description=__doc__)
    p.add_argument("--model", help="a vision checkpoint (default: a tiny one, built now)")
    p.add_argument("--text-requests", type=int, default=12)
    p.add_argument("--text-gap", type=int, default=2, help="steps between text arrivals")
    p.add_argument("--text-tokens", type=int, default=64, help="text requests' prompt length")
    p.add_argument("--image-requests", type=int, default=6)
    p.add_argument("--image-gap", type=int, default=4, help="steps between image arrivals")
    p.add_argument("--image-size", type=int, nargs=2, default=(84, 120), metavar=("H", "W"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="denoising steps per canvas")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p


def workload(
    args: argparse.Namespace, processor: ImageProcessor, kind: str, rng: random.Random
) -> list[Arrival]:
    """`kind`: alone, mixed or control (see the module docstring); fresh prompts and images."""
    vocab = processor.vision.boi_token_id  # plain tokens below the image markup

    def text(n: int) -> list[int]:
        return [rng.randrange(5, vocab) for _ in range(n)]

    out = [
        Arrival(i * args.text_gap, text(args.text_tokens), (), True)
        for i in range(args.text_requests)
    ]
    v = processor.vision
    for j in range(args.image_requests if kind != "alone" else 0):
        h, w = args.image_size
        image = processor.prepare_image(noise(h, w, rng.randrange(1 << 30)), "bench")
        marked = [v.boi_token_id, *[v.image_token_id] * image.num_tokens, v.eoi_token_id]
        ids = text(8) + marked + text(24)
        step = 1 + j * args.image_gap
        if kind == "mixed":
            out.append(Arrival(step, ids, (image,), False))
        else:  # control: the same length, no image
            out.append(Arrival(step, text(len(ids)), (), False))
    return sorted(out, key=lambda a: a.step)


def noise(height: int, width: int, seed: int) -> object:
    """A random RGB PIL image (a fresh content hash: the vision tower runs for it)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def run(llm: LLM, args: argparse.Namespace, arrivals: list[Arrival]) -> float:
    """Mean latency (s) of the text requests of one run."""
    engine, pending = llm.engine, list(arrivals)
    engine.reset_prefix_cache()
    params = SamplingParams(
        max_tokens=args.max_tokens, max_denoising_steps=args.steps, seed=1, ignore_eos=True
    )
    arrived: dict[str, float] = {}
    latency: dict[str, float] = {}
    texts: set[str] = set()
    step = 0
    while pending or engine.has_work():
        began = time.perf_counter()
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            name = f"r{len(arrived)}"
            engine.add_request(name, a.ids, llm.validator.validate(a.ids, params), images=a.images)
            arrived[name] = began
            if a.text:
                texts.add(name)
        outputs = engine.step().outputs
        ended = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"{out.request_id} failed: {out.error}")
            if out.finish_reason is not None:
                latency[out.request_id] = ended - arrived[out.request_id]
        step += 1
    return statistics.mean(latency[name] for name in texts)


def hardware() -> str:
    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}"
    cores = len(os.sched_getaffinity(0))
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {cores} cores, torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from engine.checkpoints.tiny import make_tiny

            model = str(make_tiny(f"{tmp}/tiny-vision", vision=True))
        llm = LLM.from_pretrained(model)
        processor = ImageProcessor(model)
        rng = random.Random(args.seed)
        kinds = ("alone", "mixed", "control")
        for kind in kinds:  # warm-up: every configuration once
            run(llm, args, workload(args, processor, kind, rng))
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.repeats):
            for kind in kinds:  # interleaved, so drift hits all three alike
                times[kind].append(run(llm, args, workload(args, processor, kind, rng)))
    print("command: python -m loadtest.cpu.image_mix_bench " + " ".join(argv or sys.argv[1:]))
    print(f"model: {args.model or 'make-tiny --vision (c16)'}; hardware: {hardware()}")
    median = {kind: statistics.median(values) for kind, values in times.items()}
    for kind in kinds:
        runs = ", ".join(f"{t * 1e3:.0f}" for t in times[kind])
        print(f"{kind:8s} text latency: median {median[kind] * 1e3:.0f} ms (runs: {runs} ms)")
    print(f"mixed / alone:   {median['mixed'] / median['alone']:.3f}")
    print(f"mixed / control: {median['mixed'] / median['control']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
