"""The engine core: requests in, one step at a time, outputs out (synchronous).

    step():  plan = scheduler.schedule()  →  effects = execute(plan)  →  scheduler.update(effects)

The step is a pipeline of values with one writer. `schedule` plans rows and admits requests
(their KV pages and sampler slot, acquired together); `execute` is pure — inputs, forward,
sampling, grammar and log-probabilities, and each row kind's verdict (`engine.rows`) come back
as values, and only the sampler state of rows that succeeded is stored, last; `update` alone
writes request state and ends requests (`engine.scheduler`). So a step that fails has changed
nothing, and fault isolation re-runs its rows one at a time: a row that fails again fails only
its own request.

`LLM` (offline) drives it in a loop; `AsyncEngine` drives it from its own thread. The sampler
follows the model's numerics (`engine.sampling`): batched with counter-based random streams
(fast) or the reference's per-request generators (exact); either way a request's draws depend
on its prompt, parameters and seed only.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from engine.batched_sampler import new_seed
from engine.cpu_threads import make_tuner
from engine.device.cuda import fatal_device_error
from engine.device.graphs import CudaCapture
from engine.device.memory import MemoryConfig, device_memory, model_shapes, plan_memory
from engine.inputs.images import ImageProcessor, PreparedImage, image_spans, image_token_positions
from engine.inputs.tokenizer import Tokenizer
from engine.kv_pages import KVPages
from engine.logits.kinds import kind_batches
from engine.model import DiffusionLM, PagedKVCache
from engine.model.config import LayerType
from engine.params import DecodingDefaults, ParamError, ResolvedParams
from engine.request import RequestState
from engine.rows import ROW_KINDS, RowSpec
from engine.runner import EncodeInput, ModelRunner, RunOutput, StepInputs
from engine.sampling import CanvasBatch, make_sampling
from engine.scheduler import Scheduler, SchedulerConfig
from engine.structured import Constraint, GrammarCompiler, grammar_compiler
from engine.types import (
    EngineLimits,
    RowEffect,
    ScheduledRow,
    StepPlan,
    StepResult,
    StepStats,
)
from engine.validation import RequestValidator, context_needed

logger = logging.getLogger(__name__)

# Read once, at start-up: the tests (tests/conftest.py) check every engine's accounting.
CHECK_INVARIANTS = os.environ.get("CANVAS_CHECK_INVARIANTS", "") == "1"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    page_size: int = 16
    # Positions of full-attention KV across all sequences (None: the memory plan's).
    kv_cache_tokens: int | None = None
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Verify the scheduler's accounting after every step (`Scheduler.check`): the tests
    # (CANVAS_CHECK_INVARIANTS=1) and `canvas serve --check-invariants` turn it on; it costs
    # O(pages) per step.
    check_invariants: bool = CHECK_INVARIANTS
    # Automatic prefix caching (`engine.prefix_cache`): complete prefix pages stay cached for
    # the next request that starts with the same tokens (`canvas serve --no-prefix-caching`;
    # exact numerics never cache).
    prefix_caching: bool = True
    # CPU threads of the model's operators (`engine.cpu_threads`): empty leaves torch's count
    # alone; one count is set before every step; several are measured per step and the
    # fastest runs (exact numerics, whose bits depend on the count, keep torch's own).
    # `canvas serve` measures every core but one against every core by default.
    cpu_threads: tuple[int, ...] = ()
    # Warm-up before ready (`engine.device.warmup`, `canvas serve --no-warmup`); None: where
    # the kernels compile at first use (Triton on a GPU).
    warmup: bool | None = None
    # Replay all-denoise forwards as CUDA graphs (`engine.device.graphs`, `--cuda-graphs`).
    cuda_graphs: bool = False
    # `AsyncEngine` runs a denoising step's forward while a thread of its own applies the last
    # step, hands it over and plans the next (`engine.device.overlap`, `canvas serve --overlap`).
    overlap: bool = False
    process: bool = False  # served from a process of its own (`engine.process`, `canvas serve`)

    def __post_init__(self) -> None:
        tokens = self.page_size if self.kv_cache_tokens is None else self.kv_cache_tokens
        if self.page_size < 1 or tokens < self.page_size:
            raise ValueError("page_size must be >= 1 and kv_cache_tokens >= page_size")


@dataclass(frozen=True, slots=True)
class StepBegun:
    """A planned step: what `Engine.begin` hands to `execute` and `finish`."""

    plan: StepPlan
    stats: StepStats
    start: float  # time.perf_counter() when it was begun


# A step's forward, planned (`Engine.inputs`) and launched (`Engine.forward`): its rows' kinds,
# ENCODE inputs and canvas; then the runner's inputs, or its outputs.
Planned = tuple[list[RowSpec], list[EncodeInput], CanvasBatch | None, StepInputs]
Launched = tuple[list[RowSpec], list[EncodeInput], CanvasBatch | None, RunOutput]
Write = Callable[[], None]  # a sampler state write, deferred (`Engine.execute`)


class Engine:
    def __init__(
        self,
        model: DiffusionLM,
        defaults: DecodingDefaults,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        image_processor: ImageProcessor | None = None,
    ) -> None:
        self.model = model
        self.defaults = defaults
        self.config = config or EngineConfig()
        self.canvas_length = model.config.canvas_length
        self.device = model.embed_tokens.weight.device
        cfg = model.cfg
        # What the device holds (`engine.device.memory`): the pools, slots and step it sizes.
        shapes = model_shapes(model, model.kernels.exact)
        self.plan = plan = plan_memory(shapes, self.config, device_memory(self.device))
        sched = replace(
            self.config.scheduler,
            max_num_seqs=plan.max_running_requests,
            max_num_batched_tokens=plan.tokens_per_step,
        )
        num_full, num_sliding = plan.full_pages, plan.sliding_pages
        # Exact numerics never reuse a prefix: their values depend on how a prompt is cut into
        # passes (GEMMs under SMALL_ROWS rows, per-request expert groups), so a reused prefix
        # could not give the tokens recomputing it gives (docs/prefix-caching.md).
        caching = self.config.prefix_caching and not model.kernels.exact
        self.pages = KVPages(plan.geometry, num_full, num_sliding, caching)
        # Everything besides the tokens that the KV depends on and that is fixed per engine.
        adapter = "adapter" if model.adapter is not None else "no adapter"
        salt = f"{model.kernels.describe()}|{model.embed_tokens.weight.dtype}|{adapter}"
        adaptive = sched.draft_policy.adaptive and not model.kernels.exact
        self.scheduler = Scheduler(sched, self.pages, salt, load_aware=adaptive)
        cache = PagedKVCache(
            cfg,
            {LayerType.FULL: max(num_full, 1), LayerType.SLIDING: max(num_sliding, 1)},
            self.config.page_size,
            model.embed_tokens.weight.dtype,
            self.device,
        )
        graphs = CudaCapture(self.device) if self.config.cuda_graphs else None
        self.runner = ModelRunner(model, cache, sched.max_num_seqs, graphs, plan.max_model_len)
        cpu = self.device.type == "cpu"
        self.threads = make_tuner(self.config.cpu_threads, model.kernels.exact) if cpu else None
        self.sampling = make_sampling(model, sched.max_num_seqs, self.runner.graphs)
        self.limits = self._limits()
        self.validator = RequestValidator(defaults, self.limits)
        # Structured outputs: the grammar compiler is built from the tokenizer on first use.
        self._tokenizer = tokenizer
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        # The checkpoint's image preprocessing: the warm-up prepares its image as a client's.
        self.image_processor = image_processor

    def build_constraint(self, params: ResolvedParams) -> Constraint | None:
        """The grammar state of a structured-output request (None for the others). Compiles
        its schema (cached): call it off the step loop. ParamError for a bad schema."""
        if params.json_schema is None:
            return None
        with self._grammar_lock:
            if self._grammar is None and self._tokenizer is not None:
                self._grammar = grammar_compiler(
                    self._tokenizer, self.model.cfg.vocab_size, self.defaults.eos_token_ids
                )
        if self._grammar is None:
            raise ParamError(
                "response_format", "structured output needs the checkpoint's (fast) tokenizer"
            )
        return self._grammar.constraint(params.json_schema)

    def _limits(self) -> EngineLimits:
        """What a request may ask of this engine: model config, scheduler config, KV pages."""
        cfg, sched = self.model.cfg, self.scheduler.config
        max_pos = self.plan.max_model_len
        lo, hi = 0, max_pos  # the largest context an empty cache holds (fits_ever is monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.pages.fits_ever(mid) else (lo, mid - 1)
        return EngineLimits(
            max_context_positions=max_pos,
            vocab_size=cfg.vocab_size,
            canvas_length=self.canvas_length,
            max_num_seqs=sched.max_num_seqs,
            max_inflight=sched.max_num_seqs + sched.max_queue,
            max_fit_positions=lo,
            numerics=self.model.kernels.numerics,
            kernels=self.model.kernels.backend,
            prefix_caching=self.pages.cache is not None,
        )

    # -- requests -------------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, RequestState]:
        """Every request the engine knows (waiting or running), by id (read-only view)."""
        return self.scheduler.requests

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        want_drafts: bool = False,
        constraint: Constraint | None = None,
        cache_key: str = "",
        images: tuple[PreparedImage, ...] = (),
    ) -> None:
        """Queue a request. Raises ParamError (bad prompt, too long, bad schema, image tokens
        that are not exactly the `images`' soft tokens) or QueueFull. A structured-output
        request brings its `constraint` (`build_constraint`) or has it built here.
        `cache_key`: whatever besides the token ids its KV depends on; the images' content
        hashes are added to it, so only requests with the same images share cached pages."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validator.check_prompt(prompt_ids, params)  # callers validated: a cheap second look
        self.validator.check_context(len(prompt_ids), params)
        vision = self.model.config.vision
        image_positions = image_token_positions(prompt_ids, images, vision)
        spans: tuple[tuple[int, int], ...] = ()
        if vision is not None and vision.bidirectional:
            spans = image_spans(image_positions, self.config.scheduler.max_prefill_chunk)
        req = RequestState(
            request_id,
            list(prompt_ids),
            params,
            context=context_needed(len(prompt_ids), params, self.canvas_length),
            canvas_length=self.canvas_length,
            seed=params.seed if params.seed is not None else new_seed(),
            want_drafts=want_drafts,
            constraint=constraint or self.build_constraint(params),
            cache_key="|".join((cache_key, *(image.digest for image in images))),
            images=tuple(images),
            image_positions=image_positions,
            image_spans=spans,
        )
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """End a request (waiting or running) and release what it holds. Returns whether it
        was known."""
        ended = self.scheduler.end(request_id) is not None
        if self.config.check_invariants:
            self.scheduler.check()
        return ended

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix page (running requests keep theirs); returns how many
        pages were forgotten."""
        forgotten = self.scheduler.reset_prefix_cache()
        if self.config.check_invariants:
            self.scheduler.check()
        return forgotten

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One step: `begin` (schedule), `execute` (forward, sampling), `finish` (update)."""
        began = self.begin()
        return self.finish(began, self.execute(began))

    def begin(self, threads: int = 0) -> StepBegun:
        """Plan the next step (writes scheduler state: not while another step executes).
        `threads`: the CPU thread count its forward runs with, set already (0: set here)."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.copies:
            self.runner.copy_sliding_pages(plan.copies)
        stats = StepStats(num_rows=len(plan.rows), num_tokens=plan.num_tokens)
        stats.row_kinds = dict(Counter(row.kind for row in plan.rows))
        if self.threads is not None and plan.num_tokens:
            stats.cpu_threads = threads or self.threads.choose(plan.num_tokens)
        return StepBegun(plan, stats, start)

    def finish(self, began: StepBegun, effects: list[RowEffect], end: float = 0.0) -> StepResult:
        """Apply a begun step's effects (`Scheduler.update`): its outputs and counters. `end`:
        when the step ended, if before now (a step run ahead: when the next one's forward
        began, `engine.device.overlap`)."""
        plan, stats = began.plan, began.stats
        outputs = [*plan.ended, *self.scheduler.update(plan, effects)]
        now = time.monotonic()
        stats.canvas_latencies = [
            now - row.req.canvas_started
            for row, effect in zip(plan.rows, effects, strict=True)
            if effect.progress.canvas_steps is not None and effect.error is None
        ]
        stats.num_committed = sum(len(o.new_token_ids) for o in outputs)
        stats.accepted_lengths = [e.accepted for e in effects if e.accepted is not None]
        stats.num_drafted = len(stats.accepted_lengths) * (self.canvas_length - 1)
        stats.step_seconds = (end or time.perf_counter()) - began.start
        if stats.num_tokens:
            self.scheduler.step_cost.observe(stats.num_tokens, stats.step_seconds)
        if self.threads is not None and stats.cpu_threads:
            self.threads.observe(stats.num_tokens, stats.cpu_threads, stats.step_seconds)
        if self.config.check_invariants:
            self.scheduler.check()
        return StepResult(outputs, stats)

    def execute(
        self, began: StepBegun, ahead: Launched | None = None, writes: list[Write] | None = None
    ) -> list[RowEffect]:
        """Each row's effect, computed without writing request state. A failure re-runs the
        rows one at a time (safe: nothing was written); a row that fails again gets an error
        effect, which ends only its own request. A CUDA error that the context does not
        survive (`fatal_device_error`) is raised at once: nothing can run after it. Writes only
        the runner's and the sampler's state (`engine.device.overlap` relies on it). For a step
        run ahead (`engine.device.overlap`): `ahead`, its forward, launched already; `writes`,
        where the sampler's state writes go instead of running (the caller runs them, in
        order, before anything samples again)."""
        plan, stats = began.plan, began.stats
        if not plan.rows:
            return []
        try:
            return self._run(list(plan.rows), stats, writes, ahead)
        except Exception as exc:
            if fatal_device_error(exc):
                raise
            logger.exception("a step of %d rows failed; running them one at a time", len(plan.rows))
        effects: list[RowEffect] = []
        # A request's rows stay together (a canvas's first step reads the KV that the commit
        # pass before it writes in the same forward).
        for seq_id, group in itertools.groupby(plan.rows, key=lambda row: row.seq_id):
            rows = list(group)
            try:
                effects += self._run(rows, stats)
            except Exception as exc:
                if fatal_device_error(exc):
                    raise
                logger.warning("request %s failed alone: %r", seq_id, exc)
                error = f"internal engine error ({type(exc).__name__})"
                effects += [RowEffect(error=error) for _ in rows]
        return effects

    def _run(
        self,
        rows: list[ScheduledRow],
        stats: StepStats,
        writes: list[Write] | None = None,
        ahead: Launched | None = None,
    ) -> list[RowEffect]:
        return self._land(rows, ahead or self.forward(self.inputs(rows)), stats, writes)

    def inputs(self, rows: list[ScheduledRow], canvas: CanvasBatch | None = None) -> Planned:
        """The forward's inputs of `rows` (`canvas`: the DENOISE rows' inputs, when known
        already); writes nothing but new rows' sampler parameters (`Sampling.bind`)."""
        self.sampling.bind([row.req for row in rows if row.admitted])
        specs = [ROW_KINDS[row.kind] for row in rows]
        decode = [row for row, spec in zip(rows, specs, strict=True) if spec.decode]
        encode = [(row, spec) for row, spec in zip(rows, specs, strict=True) if not spec.decode]
        inputs = [spec.encode_input(row) for row, spec in encode]
        if decode and canvas is None:
            starting = [row.starts_canvas for row in decode]
            canvas = self.sampling.canvas_inputs([row.req for row in decode], starting)
        step = StepInputs(
            denoise_starts=[row.start for row in decode],
            denoise_pages=[row.req.pages for row in decode],  # type: ignore[misc]
            canvas_ids=canvas.ids if canvas is not None else None,
            soft_embeds=canvas.soft if canvas is not None else [],
            encode=inputs,
        )
        return specs, inputs, canvas, step

    def forward(self, planned: Planned) -> Launched:
        specs, inputs, canvas, step = planned
        return specs, inputs, canvas, self.runner.execute(step)

    def _land(
        self,
        rows: list[ScheduledRow],
        ahead: Launched,
        stats: StepStats,
        writes: list[Write] | None = None,
    ) -> list[RowEffect]:
        """For each row kind present: sample its rows (`engine.rows`); the effects in plan
        order. Writes nothing but, once all of that has succeeded, the sampler state of the
        rows whose effects are not errors."""
        specs, inputs, canvas, out = ahead
        batches = kind_batches(rows, specs, inputs, canvas, out, self.sampling, stats)
        effects: list[RowEffect | None] = [None] * len(rows)
        installs = []
        for spec, (batch, where) in batches.items():
            kind_effects, install = spec.sample(batch)
            for i, effect in zip(where, kind_effects, strict=True):
                effects[i] = effect
            installs.append((install, [e.error is None for e in kind_effects]))
        forward_seconds, sample_seconds = out.clock.seconds()
        stats.forward_seconds += forward_seconds
        stats.sample_seconds += sample_seconds
        for install, ok in installs:
            if writes is None:
                install(ok)
            else:
                writes.append(partial(install, ok))
        return effects  # type: ignore[return-value]
