"""The engine core: requests in, one step at a time, outputs out (synchronous).

    step():  plan = scheduler.schedule() → out = runner.execute(inputs) → sample → publish

`LLM` (offline) drives it in a loop; `AsyncEngine` drives it from its own thread. The sampler
follows the model's numerics (`engine.sampling`): batched with counter-based random streams
(fast) or the reference's per-request generators (exact); either way a request's draws depend
on its prompt, parameters and seed only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from engine.kv_pages import KVPages, PageGeometry, PageTables
from engine.model import DiffusionLM, PagedKVCache
from engine.model.config import LayerType
from engine.params import DecodeMode, DecodingDefaults, ParamError, ResolvedParams
from engine.request import Request
from engine.runner import EncodeInput, ModelRunner, RunOutput, StepInputs
from engine.sampling import Sampled, make_sampling
from engine.scheduler import RowKind, ScheduledRow, Scheduler, SchedulerConfig, Sequence, StepPlan


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    page_size: int = 16
    kv_cache_tokens: int = 131_072  # positions of full-attention KV across all sequences

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_cache_tokens < self.page_size:
            raise ValueError("page_size must be >= 1 and kv_cache_tokens >= page_size")


@dataclass(frozen=True, slots=True)
class RequestStats:
    num_prompt_tokens: int
    num_output_tokens: int
    decoder_passes: int
    encoder_passes: int
    steps_per_canvas: tuple[int, ...]
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float

    @property
    def tokens_per_forward(self) -> float:
        passes = self.decoder_passes or self.encoder_passes
        return self.num_output_tokens / passes if passes else 0.0


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step publishes for one request: committed tokens (never revised), the draft
    of an unfinished canvas (when asked for), and on the last output the finish reason."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    draft: list[int] | None = None
    stats: RequestStats | None = None


@dataclass(slots=True)
class StepStats:
    """Counters of the last step, for metrics and the overhead benchmark."""

    num_rows: int = 0
    num_tokens: int = 0
    num_committed: int = 0
    forward_seconds: float = 0.0
    sample_seconds: float = 0.0  # the sampler's arithmetic and its host transfer
    step_seconds: float = 0.0
    canvas_latencies: list[float] = field(default_factory=list)  # committed canvases


def first_cut(
    draft: list[int], budget: int, eos_token_ids: frozenset[int]
) -> tuple[list[int], str | None]:
    """Cut a committed draft at the first EOS (kept) and at the remaining token budget."""
    for i, token in enumerate(draft[:budget]):
        if token in eos_token_ids:
            return draft[: i + 1], "stop"
    if len(draft) >= budget:
        return draft[:budget], "length"
    return draft, None


class Engine:
    def __init__(
        self, model: DiffusionLM, defaults: DecodingDefaults, config: EngineConfig | None = None
    ) -> None:
        self.model = model
        self.defaults = defaults
        self.config = config or EngineConfig()
        self.canvas_length = model.config.canvas_length
        self.device = model.embed_tokens.weight.device
        cfg = model.cfg
        sched = self.config.scheduler
        geometry = PageGeometry(
            page_size=self.config.page_size,
            sliding_window=cfg.sliding_window,
            max_pass_tokens=max(sched.max_prefill_chunk, self.canvas_length),
            has_full=any(not s.is_sliding for s in cfg.layers),
            has_sliding=any(s.is_sliding for s in cfg.layers),
        )
        num_full = self.config.kv_cache_tokens // self.config.page_size
        num_sliding = sched.max_num_seqs * geometry.sliding_ring(cfg.max_position_embeddings)
        self.pages = KVPages(geometry, num_full, num_sliding)
        self.scheduler = Scheduler(sched, self.pages)
        cache = PagedKVCache(
            cfg,
            {LayerType.FULL: max(num_full, 1), LayerType.SLIDING: max(num_sliding, 1)},
            self.config.page_size,
            model.embed_tokens.weight.dtype,
            self.device,
        )
        self.runner = ModelRunner(model, cache)
        self.sampling = make_sampling(model, sched.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self.last_step = StepStats()

    # -- requests -------------------------------------------------------------------------------

    def context_needed(self, num_prompt: int, params: ResolvedParams) -> int:
        """Positions a request occupies: diffusion canvases are whole even when cut."""
        if params.mode is DecodeMode.AR:
            return num_prompt + params.max_tokens
        return num_prompt + math.ceil(params.max_tokens / self.canvas_length) * self.canvas_length

    def check_prompt(self, ids: list[int]) -> None:
        vocab = self.model.cfg.vocab_size
        if not ids:
            raise ParamError("prompt", "must contain at least one token")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")

    def check_context(self, num_prompt: int, params: ResolvedParams) -> None:
        limit = self.model.cfg.max_position_embeddings
        needed = self.context_needed(num_prompt, params)
        if needed > limit:
            raise ParamError(
                "max_tokens",
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) needs {needed} "
                f"positions, more than the model's context of {limit}",
            )
        if not self.pages.fits_ever(needed):
            raise ParamError("max_tokens", f"{needed} positions do not fit in the KV cache")

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        want_drafts: bool = False,
    ) -> None:
        """Queue a request. Raises ParamError (bad prompt, too long) or QueueFull."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check_prompt(prompt_ids)
        self.check_context(len(prompt_ids), params)
        seq = Sequence(
            seq_id=request_id,
            num_prompt=len(prompt_ids),
            context=self.context_needed(len(prompt_ids), params),
            canvas_length=self.canvas_length,
            is_ar=params.mode is DecodeMode.AR,
        )
        self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, list(prompt_ids), params, want_drafts)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its pages. Returns whether it was known."""
        self.scheduler.finish(request_id)
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.sampling.release(req)
        return req is not None

    @property
    def numerics(self) -> str:
        return self.model.kernels.describe()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.rows:
            self.last_step = StepStats()
            return []
        self.last_step = StepStats(num_rows=len(plan.rows), num_tokens=plan.num_tokens)
        denoise, encode = self._split(plan)
        out = self.runner.execute(self._inputs(denoise, encode))
        outputs = self._sample(denoise, encode, out)
        self.last_step.num_committed = sum(len(o.new_token_ids) for o in outputs)
        self.last_step.forward_seconds = out.forward_seconds
        self.last_step.step_seconds = time.perf_counter() - start
        return outputs

    def _split(
        self, plan: StepPlan
    ) -> tuple[list[tuple[ScheduledRow, Request]], list[tuple[ScheduledRow, Request]]]:
        """The plan's DENOISE and ENCODE rows with their requests; newly running requests get
        their sampler state."""
        now = time.monotonic()
        denoise, encode = [], []
        for row in plan.rows:
            req = self.requests[row.seq_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self.sampling.admit(req)
            (denoise if row.kind is RowKind.DENOISE else encode).append((row, req))
        return denoise, encode

    def _pages(self, row: ScheduledRow) -> PageTables:
        pages = self.scheduler.running[row.seq_id].pages
        assert pages is not None
        return pages

    def _inputs(
        self,
        denoise: list[tuple[ScheduledRow, Request]],
        encode: list[tuple[ScheduledRow, Request]],
    ) -> StepInputs:
        canvas_ids, soft = None, []
        if denoise:
            now = time.monotonic()
            for _, req in denoise:
                if not req.in_canvas:
                    req.canvas_started = now
            canvas_ids, soft = self.sampling.canvas_inputs([req for _, req in denoise])
        return StepInputs(
            denoise_starts=[row.start for row, _ in denoise],
            denoise_pages=[self._pages(row) for row, _ in denoise],
            canvas_ids=canvas_ids,
            soft_embeds=soft,
            encode=[self._encode_input(row, req) for row, req in encode],
        )

    def _encode_input(self, row: ScheduledRow, req: Request) -> EncodeInput:
        if row.kind is RowKind.PREFILL:
            tokens = req.prompt_ids[row.start : row.start + row.num_tokens]
            return EncodeInput(row.start, tokens, self._pages(row), self._wants_token(row, req))
        if row.kind is RowKind.COMMIT:
            assert req.draft_to_commit is not None
            return EncodeInput(row.start, req.draft_to_commit, self._pages(row), False)
        return EncodeInput(row.start, req.output_ids[-1:], self._pages(row), True)

    def _sample(
        self,
        denoise: list[tuple[ScheduledRow, Request]],
        encode: list[tuple[ScheduledRow, Request]],
        out: RunOutput,
    ) -> list[StepOutput]:
        ar = [(row, req) for row, req in encode if self._wants_token(row, req)]
        start = time.perf_counter()
        sampled = self.sampling.sample(
            out.denoise_logits, [r for _, r in denoise], out.last_logits, [r for _, r in ar]
        )
        self.last_step.sample_seconds = time.perf_counter() - start
        outputs: list[StepOutput] = []
        for j, (row, req) in enumerate(denoise):
            req.decoder_passes += 1
            outputs += self._after_denoise(row, req, sampled, j)
        tokens = dict(zip([id(r) for _, r in ar], sampled.ar_tokens, strict=True))
        for row, req in encode:
            req.encoder_passes += 1
            self.scheduler.on_row_done(row)
            if id(req) in tokens:
                outputs += self._after_ar_token(req, tokens[id(req)])
        return outputs

    @staticmethod
    def _wants_token(row: ScheduledRow, req: Request) -> bool:
        if row.kind is RowKind.AR:
            return True
        end = row.start + row.num_tokens
        return (
            row.kind is RowKind.PREFILL
            and req.params.mode is DecodeMode.AR
            and end == len(req.prompt_ids)
        )

    def _after_denoise(
        self, row: ScheduledRow, req: Request, sampled: Sampled, j: int
    ) -> list[StepOutput]:
        draft = sampled.drafts[j]
        if not sampled.finished[j]:
            self.scheduler.on_row_done(row)
            if req.want_drafts and draft is not None:
                return [StepOutput(req.request_id, [], draft=draft)]
            return []
        assert draft is not None
        req.steps_per_canvas.append(sampled.num_steps[j])
        self.last_step.canvas_latencies.append(time.monotonic() - req.canvas_started)
        req.in_canvas = False
        tokens, reason = first_cut(
            draft, req.params.max_tokens - len(req.output_ids), req.params.eos_token_ids
        )
        if reason is None:
            req.draft_to_commit = draft
            self.scheduler.on_row_done(row, canvas_finished=True)
        return [self._emit(req, tokens, reason)]

    def _after_ar_token(self, req: Request, token: int) -> list[StepOutput]:
        reason = None
        if token in req.params.eos_token_ids:
            reason = "stop"
        elif len(req.output_ids) + 1 >= req.params.max_tokens:
            reason = "length"
        return [self._emit(req, [token], reason)]

    def _emit(self, req: Request, tokens: list[int], reason: str | None) -> StepOutput:
        now = time.monotonic()
        if tokens and req.first_token_time is None:
            req.first_token_time = now
        req.output_ids += tokens
        if reason is None:
            return StepOutput(req.request_id, tokens)
        self.scheduler.finish(req.request_id)
        del self.requests[req.request_id]
        self.sampling.release(req)
        stats = RequestStats(
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
            decoder_passes=req.decoder_passes,
            encoder_passes=req.encoder_passes,
            steps_per_canvas=tuple(req.steps_per_canvas),
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finish_time=now,
        )
        return StepOutput(req.request_id, tokens, reason, stats=stats)
