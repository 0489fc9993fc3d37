"""Warm-up before ready: the step loop runs throwaway requests of every decode mode before the
server says ready, so that the first step of each kind of row, which JIT-compiles its Triton
kernels (seconds each at the real shapes), never runs inline under traffic, where it would
stall the first requests and could outlast a liveness probe.

    warm_up(engine):  for each step size (`step_buckets`), for each mode: add its requests
                      (the first mode's first with an image), step until they end (at most
                      ROUND_STEPS steps), abort what is left; at size 1, then a round per
                      mode of one request with a JSON schema

Sizes: every integer that varies per step is left unspecialised and block sizes are fixed
(`kernels.triton_*`, checked by tests/kernels/test_specialisation.py), so a kernel compiles once
per constexpr set whatever the step's size. Two sizes then cover them: one request per mode, and
as many as one step runs; the largest also takes the step's peak memory before ready, and crosses
to 64-bit element counts where a launch's size needs them.

Images: where the engine has its checkpoint's image processor (`Engine.image_processor`, a
vision checkpoint built by `engine.build`), the first request of the first mode at each size
carries an image: a gray picture made in memory, encoded, decoded and preprocessed by that
processor and placed in its prompt by `expand_image_tokens`, exactly as a client's image is. So
the vision tower runs, and the prefill compiles attention's variant for image spans (`HAS_SPAN`:
an image's tokens attend to the whole image), before ready. An engine built from a model alone
(`LLM(model, ...)`, the GPU benchmark's) has no processor and sends no image (logged).

Structured outputs: the grammar compiles no kernel. llguidance runs on the host, and what the
device does for it is eager PyTorch (an AR row's masked_fill, a repaired position's argmax,
a hybrid verification's per-position mask), kernels PyTorch ships built. Its first use has a
cost all the same: the grammar compiler (llguidance's view of the tokenizer's whole vocabulary,
built once per engine) and the schema's grammar. One request with a small JSON schema per mode
(AR masking, diffusion repair, hybrid verification) builds the compiler and runs each path once,
so the first structured request does not wait for it. An engine without a tokenizer serves no
structured output and skips these rounds.

What it leaves behind: nothing a request or a metric sees. Its requests end (aborted when still
running), so their KV pages and sampler slots are free; the prefix cache forgets every page, the
vision cache every image; the scheduler forgets its step-cost fit, acceptance prior and
prefix-cache counters (`Scheduler.forget_history`); the async engine counts none of its steps
and calls no step listener (metrics). What stays is what it is for: compiled kernels (in memory
and in TRITON_CACHE_DIR, `triton_cache_dir`), the allocator's pool grown to the largest step,
and the grammar compiler (with its schema's compiled grammar, which changes no other request).
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoints.default import cache_dir
from engine.inputs.images import ImageProcessor, PreparedImage, expand_image_tokens
from engine.modes import mode_names
from engine.params import ParamError, SamplingParams
from engine.rows import ROW_KINDS
from kernels.support import interpreting

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)

# Steps per round (one mode, one size) besides its prompts': enough for each built-in mode to
# run each of its kinds (a canvas step, its commit or verify pass, an AR token); a round that
# has not ended by then (AR runs a token a step) is aborted.
ROUND_STEPS = 8
# An odd prompt length: no prefill is a size a kernel could be specialised on.
PROMPT_TOKENS = 37
# The throwaway requests' ids (no client's request is added while the step loop warms up: its
# commands wait in the loop's queue).
REQUEST_PREFIX = "canvas-warmup-"
# The image: plain gray, any size (the processor resizes every picture to its patch budget; the
# tower is eager PyTorch, and the span attention a prefill compiles is the same for any image).
IMAGE_SIZE = (96, 64)  # width, height
IMAGE_GRAY = 128
# A document of a few tokens: the closing policy ends it within one canvas.
SCHEMA = json.dumps(
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
)

Key = tuple[int, str]  # (requests per mode, row kind)


@dataclass(slots=True)
class WarmupReport:
    """What a warm-up ran: per (requests per mode, row kind) the rows, the steps that ran that
    kind and their seconds; in all, the steps, throwaway requests (and those that failed, those
    with an image, those with a JSON schema) and seconds."""

    rows: dict[Key, int] = field(default_factory=dict)
    steps: dict[Key, int] = field(default_factory=dict)
    seconds: dict[Key, float] = field(default_factory=dict)
    num_steps: int = 0
    num_requests: int = 0
    total_seconds: float = 0.0
    num_failed: int = 0
    num_images: int = 0  # requests with an image
    num_structured: int = 0  # requests with a JSON schema

    def kinds(self) -> set[str]:
        return {kind for _, kind in self.rows}

    def record(self, bucket: int, row_kinds: dict[str, int], seconds: float) -> None:
        self.num_steps += 1
        for kind, count in row_kinds.items():
            key = (bucket, _name(kind))
            self.rows[key] = self.rows.get(key, 0) + count
            self.steps[key] = self.steps.get(key, 0) + 1
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds


def _name(kind: str) -> str:
    return kind.value if isinstance(kind, Enum) else kind


def wants_warmup(engine: Engine) -> bool:
    """`EngineConfig.warmup`, or where it is None (the default), whether the engine's kernels
    compile at first use: Triton's, compiled (not interpreted). The native CPU kernels build
    when the backend binds, at load, and the twins compile nothing: a CPU engine starts at
    once."""
    if engine.config.warmup is not None:
        return engine.config.warmup
    return engine.model.kernels.backend == "triton" and not interpreting()


def step_buckets(engine: Engine) -> tuple[int, ...]:
    """Requests per mode of each warm-up round: one, and as many as one step runs (the
    sequences that run at once, bounded by the canvases the token budget holds)."""
    sched = engine.scheduler.config
    canvases = max(1, sched.max_num_batched_tokens // engine.canvas_length)
    return tuple(sorted({1, min(sched.max_num_seqs, canvases)}))


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels: $TRITON_CACHE_DIR where the user set it, else
    `triton/` under Canvas' cache directory (set in the environment here, before anything
    compiles), so a restarted server (and the Helm chart's pod, whose cache volume holds it)
    finds its kernels compiled instead of in ~/.triton."""
    chosen = os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
    return Path(chosen)


def warm_up(engine: Engine, should_stop: Callable[[], bool] = lambda: False) -> WarmupReport:
    """Run one step of every row kind at each size (`step_buckets`), an image request at each
    size (a vision checkpoint's) and a JSON-schema request per mode, logging a line per size
    and kind, and a total; return what ran. Call it on the thread that steps the engine, before
    any other request is added. A failure is logged and ends the warm-up (serving goes on:
    the first requests then compile what it did not); either way the engine is left as it
    was: no request, no cached prefix or image, no scheduler history. `should_stop`: checked
    before each step (shutdown)."""
    report = WarmupReport()
    began = time.perf_counter()
    buckets, modes = step_buckets(engine), mode_names()
    logger.info(
        "warm-up: compiling kernels before ready (%s requests per mode, modes %s)",
        " and ".join(map(str, buckets)),
        ", ".join(modes),
    )
    try:
        if engine.runner.graphs is not None:  # captured largest first; the rounds replay them
            engine.runner.graphs.capture_all(engine.plan.canvases_per_step)
        if engine.runner.ar.graphs is not None:  # then the AR rows' buckets, in the same pool
            engine.runner.ar.graphs.capture_all()
        image = warmup_image(engine)
        for bucket in buckets:
            for mode in modes:
                if should_stop():
                    return report
                first = image if mode == modes[0] else None
                _round(engine, bucket, mode, report, should_stop, image=first)
            for mode in modes if bucket == 1 else ():  # a JSON schema, one request at a time
                if should_stop() or not _round(engine, 1, mode, report, should_stop, schema=SCHEMA):
                    break  # no tokenizer (logged): no structured output to warm up
            _log_bucket(report, bucket)
    except Exception:
        logger.exception("warm-up failed; serving without it (first requests may compile)")
    finally:
        for request_id in [r for r in engine.requests if r.startswith(REQUEST_PREFIX)]:
            engine.abort(request_id)
        engine.reset_prefix_cache()
        _forget_images(engine)
        engine.scheduler.forget_history()
        report.total_seconds = time.perf_counter() - began
    missing = sorted(set(map(_name, ROW_KINDS)) - report.kinds())
    logger.info(
        "warm-up: done in %.1f s, %d steps, %d row kinds, %d image and %d JSON-schema requests%s",
        report.total_seconds,
        report.num_steps,
        len(report.kinds()),
        report.num_images,
        report.num_structured,
        f" (none ran: {', '.join(missing)})" if missing else "",
    )
    if report.num_failed:
        logger.warning("warm-up: %d throwaway requests failed (see above)", report.num_failed)
    return report


def warmup_image(engine: Engine) -> PreparedImage | None:
    """The warm-up's image, prepared by the engine's image processor as a client's is: a gray
    picture, PNG-encoded in memory, decoded and preprocessed (`ImageProcessor.prepare`). None
    (logged) where the engine has no processor or it refuses the picture."""
    processor: ImageProcessor | None = engine.image_processor
    if processor is None:
        if engine.model.config.vision is not None:
            logger.info("warm-up: no image (the engine has no image processor)")
        return None
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", IMAGE_SIZE, (IMAGE_GRAY,) * 3).save(buffer, format="PNG")
    try:
        image = processor.prepare(buffer.getvalue(), "warm-up image")
    except ParamError as exc:
        logger.warning("warm-up: no image: %s", exc)
        return None
    logger.info("warm-up: an image of %d soft tokens at each size", image.num_tokens)
    return image


def _round(
    engine: Engine,
    bucket: int,
    mode: str,
    report: WarmupReport,
    should_stop: Callable[[], bool],
    image: PreparedImage | None = None,
    schema: str | None = None,
) -> bool:
    """`bucket` throwaway requests of `mode` (the first with `image`, each with `schema`, when
    given), stepped until they end or for ROUND_STEPS steps besides those their prompts take;
    those still running are aborted. Returns whether its requests were taken."""
    engine.scheduler.forget_history()  # each round as a fresh server (hybrid drafts first)
    # A second canvas, so that the first is committed (diffusion) or verified (hybrid); a
    # schema's document ends with an end token, which ignore_eos would refuse.
    params = SamplingParams(
        max_tokens=engine.canvas_length + 1,
        mode=mode,
        seed=0,
        ignore_eos=schema is None,
        max_denoising_steps=1,
        json_schema=schema,
    )
    ids, num_tokens = [], 0
    for i in range(bucket):
        request_id = f"{REQUEST_PREFIX}{bucket}-{mode}{'-json' if schema else ''}-{i}"
        images = (image,) if image is not None and i == 0 else ()
        added = _add(engine, request_id, params, report, images)
        if not added and images:  # e.g. an image longer than a prefill chunk: go on without
            added = _add(engine, request_id, params, report, ())
        if not added:
            break
        ids.append(request_id)
        num_tokens += added
    budget = engine.scheduler.config.max_num_batched_tokens
    for _ in range(ROUND_STEPS + -(-num_tokens // budget)):  # + the prompts' steps
        if should_stop() or not any(r in engine.requests for r in ids):
            break
        begin = time.perf_counter()
        result = engine.step()
        report.record(bucket, result.stats.row_kinds, time.perf_counter() - begin)
        report.num_failed += sum(1 for out in result.outputs if out.error)
    for request_id in ids:
        engine.abort(request_id)
    _forget_images(engine)  # so that the tower runs again at the next size
    return bool(ids)


def _add(
    engine: Engine,
    request_id: str,
    params: SamplingParams,
    report: WarmupReport,
    images: tuple[PreparedImage, ...],
) -> int:
    """Add a throwaway request (a distinct prompt, with `images`); its prompt's length, or 0
    (logged) when the engine refuses it."""
    prompt = _prompt(engine, report.num_requests * PROMPT_TOKENS, images)
    try:
        resolved = engine.validator.resolve(len(prompt), params)
        engine.add_request(request_id, prompt, resolved, images=images)
    except (ParamError, ValueError) as exc:
        what = " with a JSON schema" if params.json_schema else " with an image" if images else ""
        logger.warning("warm-up: a request of mode %s%s skipped: %s", params.mode, what, exc)
        return 0
    report.num_requests += 1
    report.num_images += len(images)
    report.num_structured += params.json_schema is not None
    return len(prompt)


def _prompt(engine: Engine, first: int, images: tuple[PreparedImage, ...]) -> list[int]:
    """PROMPT_TOKENS token ids from `first` on (distinct prompts: no shared prefix); with an
    image, its placeholder in the middle expanded as a client's prompt is."""
    vocab = engine.model.cfg.vocab_size
    prompt = [(first + t) % vocab for t in range(PROMPT_TOKENS)]
    if not images:
        return prompt
    vision = engine.model.config.vision
    assert vision is not None, "images reach only a vision checkpoint's warm-up"
    markup = (vision.boi_token_id, vision.image_token_id, vision.eoi_token_id)
    text = [t for t in prompt if t not in markup]
    half = len(text) // 2
    return expand_image_tokens(
        [*text[:half], vision.image_token_id, *text[half:]], list(images), vision
    )


def _forget_images(engine: Engine) -> None:
    if engine.runner.vision is not None:
        engine.runner.vision.clear()


def _log_bucket(report: WarmupReport, bucket: int) -> None:
    for (size, kind), rows in sorted(report.rows.items()):
        if size == bucket:
            key = (size, kind)
            logger.info(
                "warm-up: %d per mode, %-8s %4d rows in %3d steps, %.2f s",
                size,
                kind,
                rows,
                report.steps[key],
                report.seconds[key],
            )
