"""After the warm-up, serving compiles nothing new: issue 42's Goal, "1,000 mixed requests
(diffusion, AR, hybrid; prompts of varied length; JSON schema; images) compile and build nothing
new (counted)". The tiny vision checkpoint (`engine.checkpoints.tiny`, `vision=True`: sliding
and full attention layers (k_eq_v) with experts at a toy scale, a working vision tower, a
tokenizer for the grammar) in bf16 on the Triton kernels: `engine.device.warmup` runs, then
1,000 mixed requests (every mode, prompts of 1 to 133 tokens, one or two images of several
sizes, JSON schemas, logprobs, top-k and top-p, requests joining mid-flight, so steps of every
mix and row count) are served while Triton's `jit_cache_hook` counts every kernel it has to
compile or load (each new specialisation, whether its binary is on disk or not). Marked gpu
(`make gpu-check` runs it; skipped elsewhere). On the CPU, the first requests of the same mix
are served on the PyTorch twins after a warm-up (a few seconds: an engine, its warm-up, 20
requests), so the traffic it builds is checked where no GPU is."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.build import CheckpointConfig, build_engine, open_checkpoint
from engine.device.warmup import warm_up
from engine.engine import Engine, EngineConfig
from engine.inputs.images import PreparedImage, expand_image_tokens
from engine.params import DecodeMode, SamplingParams
from engine.scheduler import SchedulerConfig
from kernels import triton_available
from tests.media import encode, noise_image

PROMPT_LENGTHS = (1, 5, 40, 70, 133)
MODES = (DecodeMode.DIFFUSION, DecodeMode.AR, DecodeMode.HYBRID)
NUM_REQUESTS = 1000  # the Goal's count
CPU_REQUESTS = 20  # on the twins: every kind of request of the mix (images, schemas), in seconds
# (height, width): padded to the patch budget, exactly the budget (no mask in the tower),
# upscaled, a long strip, downscaled (tests/e2e/test_vision.py's sizes).
IMAGE_SIZES = ((50, 90), (84, 120), (13, 17), (12, 300), (300, 240))
SCHEMAS = (
    json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    json.dumps({"type": "array", "items": {"type": "string"}, "maxItems": 3}),
)


@dataclass(frozen=True, slots=True)
class MixedRequest:
    """A prompt of `prompt_length` text tokens with `images` ((height, width, seed) each)."""

    prompt_length: int
    params: SamplingParams
    images: tuple[tuple[int, int, int], ...] = ()


def mixed_requests(length: int, count: int) -> list[MixedRequest]:
    """`count` requests: first each mode with each prompt length, then random lengths of 1 to
    133; one image every tenth request and two every tenth (sizes and pixels varied, some seen
    before: the vision cache's hits and misses), a JSON schema every fourth, logprobs, top-k,
    top-p and temperatures spread among them."""
    rng = np.random.default_rng(0)
    requests = []
    for i in range(count):
        mode, fixed = MODES[i % len(MODES)], len(MODES) * len(PROMPT_LENGTHS)
        n = PROMPT_LENGTHS[i // len(MODES) % len(PROMPT_LENGTHS)] if i < fixed else 0
        n = n or int(rng.integers(1, 134))
        schema = SCHEMAS[i // 4 % 2] if i % 4 == 3 else None
        num_images = (i % 10 == 1) + 2 * (i % 10 == 6)
        images = tuple(
            (*IMAGE_SIZES[(i + k) % len(IMAGE_SIZES)], int(rng.integers(0, 4)))
            for k in range(num_images)
        )
        params = SamplingParams(
            max_tokens=3 if i % 2 else length + 5,
            max_denoising_steps=2 + i % 4,  # canvases of several step counts, in few steps
            mode=mode,
            seed=i,
            ignore_eos=schema is None,  # a document ends with an end token
            json_schema=schema,
            temperature=0.0 if i % 7 == 0 else 0.7,
            logprobs=2 if i % 4 == 0 else None,
            top_k=5 if i % 5 == 1 else None,
            top_p=0.9 if i % 5 == 2 else None,
        )
        requests.append(MixedRequest(n, params, images))
    return requests


def serve_mixed(engine: Engine, requests: list[MixedRequest]) -> set[str]:
    """Serve `requests` (prompts of random text tokens with their images' placeholders spread
    among them, expanded as a client's prompt is), up to three joining every other step while
    fewer than the running slots wait; returns the ids that finished."""
    vision, processor = engine.model.config.vision, engine.image_processor
    assert vision is not None and processor is not None, "a vision checkpoint's engine"
    markup = {vision.boi_token_id, vision.image_token_id, vision.eoi_token_id}
    text_ids = np.array([t for t in range(engine.model.cfg.vocab_size) if t not in markup])
    gen = np.random.default_rng(1)
    prepared: dict[tuple[int, int, int], PreparedImage] = {}

    def add(name: str, req: MixedRequest) -> None:
        for spec in req.images:
            if spec not in prepared:
                prepared[spec] = processor.prepare(encode(noise_image(*spec)), "image")
        images = [prepared[spec] for spec in req.images]
        pieces = np.array_split(gen.choice(text_ids, req.prompt_length), len(images) + 1)
        ids = [*pieces[0].tolist()]
        for piece in pieces[1:]:
            ids += [vision.image_token_id, *piece.tolist()]
        prompt = expand_image_tokens(ids, images, vision)
        resolved = engine.validator.resolve(len(prompt), req.params)
        engine.add_request(name, prompt, resolved, images=tuple(images))

    waiting, finished = list(requests), set()
    room = engine.scheduler.config.max_num_seqs + 3
    for step in range(100 * len(requests)):
        for _ in range(3 if step % 2 == 0 else 0):
            if waiting and len(engine.requests) < room:
                add(f"r{len(requests) - len(waiting)}", waiting.pop(0))
        if not engine.has_work() and not waiting:
            break
        for out in engine.step().outputs:
            assert out.error is None, out.error
            finished |= {out.request_id} if out.finish_reason else set()
    return finished


def vision_engine(path: Path, **checkpoint: Any) -> Engine:
    """The vision checkpoint's engine, as `canvas serve` builds it (its image processor
    threaded), running up to 16 requests in steps of up to 8 canvases."""
    opened = open_checkpoint(CheckpointConfig(path, **checkpoint))
    canvas = opened.model.config.canvas_length
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8 * canvas)
    return build_engine(opened, EngineConfig(sched, 16, 1024 * 16))


def test_the_mixed_traffic_is_served_on_the_twins(vision_checkpoint: Path) -> None:
    """Where no GPU is: the mix's requests are valid and served after a warm-up (images, JSON
    schemas and all), on the PyTorch twins."""
    engine = vision_engine(vision_checkpoint, kernels="twins")
    report = warm_up(engine)
    assert report.num_failed == 0 and report.num_images == 2 and report.num_structured == 3
    requests = mixed_requests(engine.canvas_length, CPU_REQUESTS)
    assert any(r.params.json_schema for r in requests)
    assert {len(r.images) for r in requests} == {0, 1, 2}
    assert len(serve_mixed(engine, requests)) == CPU_REQUESTS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_serving_after_the_warm_up_compiles_no_kernel(request: pytest.FixtureRequest) -> None:
    from triton import knobs

    try:
        from transformers import DiffusionGemmaConfig  # noqa: F401
    except ImportError:
        pytest.skip(
            "building a tiny checkpoint needs transformers>=5.23: carry wheels/ "
            "(loadtest/README.md, GPU check)"
        )
    path = request.getfixturevalue("vision_checkpoint")
    engine = vision_engine(path, dtype="bfloat16", device="cuda", kernels="triton")
    report = warm_up(engine)
    assert report.num_failed == 0 and report.num_steps > 0
    assert report.num_images == 2 and report.num_structured == len(MODES)
    compiled: list[str] = []

    def count(*, fn: Any, **_: Any) -> bool:
        compiled.append(fn.name)
        return False  # compile as usual

    requests = mixed_requests(engine.canvas_length, NUM_REQUESTS)
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, count
    try:
        finished = serve_mixed(engine, requests)
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert len(finished) == NUM_REQUESTS
    assert compiled == [], f"compiled after the warm-up: {sorted(set(compiled))}"
