"""The engine core: requests in, one step at a time, outputs out (synchronous).

    step():  plan = scheduler.schedule() → out = runner.execute(inputs) → sample → publish

`LLM` (offline) drives it in a loop; `AsyncEngine` drives it from its own thread. The sampler
follows the model's numerics (`engine.sampling`): batched with counter-based random streams
(fast) or the reference's per-request generators (exact); either way a request's draws depend
on its prompt, parameters and seed only.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.kv_pages import KVPages, PageGeometry
from engine.model import DiffusionLM, PagedKVCache
from engine.model.base import SoftEmbeds
from engine.model.config import LayerType
from engine.params import DecodingDefaults, ParamError, ResolvedParams
from engine.postprocess import after_sampling, before_sampling
from engine.request import RequestState
from engine.rows import ROW_KINDS, RowResult
from engine.runner import ModelRunner, RunOutput, StepInputs
from engine.sampling import Sampled, make_sampling
from engine.scheduler import ScheduledRow, Scheduler, SchedulerConfig
from engine.structured import Constraint, GrammarCompiler, grammar_compiler
from engine.tokenizer import Tokenizer
from engine.types import (
    EngineLimits,
    FinishReason,
    RequestStats,
    StepOutput,
    StepResult,
    StepStats,
    TokenLogprob,
)
from engine.validation import RequestValidator, context_needed

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    page_size: int = 16
    kv_cache_tokens: int = 131_072  # positions of full-attention KV across all sequences

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.kv_cache_tokens < self.page_size:
            raise ValueError("page_size must be >= 1 and kv_cache_tokens >= page_size")


class Engine:
    def __init__(
        self,
        model: DiffusionLM,
        defaults: DecodingDefaults,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
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
        self.limits = self._limits()
        self.validator = RequestValidator(defaults, self.limits)
        self.requests: dict[str, RequestState] = {}
        self._stats = StepStats()  # the step in progress
        # Structured outputs: the grammar compiler is built from the tokenizer on first use.
        self._tokenizer = tokenizer
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

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
        max_pos = cfg.max_position_embeddings
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
        )

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        want_drafts: bool = False,
        constraint: Constraint | None = None,
    ) -> None:
        """Queue a request. Raises ParamError (bad prompt, too long, bad schema) or QueueFull.
        A structured-output request brings its `constraint` (`build_constraint`) or has it
        built here."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validator.check_prompt(prompt_ids)  # callers validated: a cheap second look
        self.validator.check_context(len(prompt_ids), params)
        req = RequestState(
            request_id,
            list(prompt_ids),
            params,
            context=context_needed(len(prompt_ids), params, self.canvas_length),
            canvas_length=self.canvas_length,
            want_drafts=want_drafts,
            constraint=constraint or self.build_constraint(params),
        )
        self.scheduler.add(req)
        self.requests[request_id] = req

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

    def step(self) -> StepResult:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self._stats = StepStats(num_rows=len(plan.rows), num_tokens=plan.num_tokens)
        if not plan.rows:
            return StepResult([], self._stats)
        try:
            outputs = self._run(list(plan.rows))
        except Exception:
            logger.exception("a step of %d rows failed; running them one at a time", len(plan.rows))
            outputs = self._run_isolated(list(plan.rows))
        self._stats.num_committed = sum(len(o.new_token_ids) for o in outputs)
        self._stats.step_seconds = time.perf_counter() - start
        return StepResult(outputs, self._stats)

    def _run(self, rows: list[ScheduledRow]) -> list[StepOutput]:
        """Forward and sample `rows`; nothing has advanced if this raises. Then each row's
        after-step (state changes, outputs)."""
        denoise, encode = self._split(rows)
        out = self.runner.execute(self._inputs(denoise, encode))
        self._stats.forward_seconds += out.forward_seconds
        results = self._sample(denoise, encode, out)
        outputs: list[StepOutput] = []
        for row in (*denoise, *encode):
            result = results.get(id(row), RowResult())
            if result.failed:
                outputs.append(self.fail(row.req, "the model produced non-finite logits"))
            else:
                outputs += ROW_KINDS[row.kind].after(self, row, result)
        return outputs

    def _run_isolated(self, rows: list[ScheduledRow]) -> list[StepOutput]:
        """A step failed and the fault could not be put on one request: each row runs alone,
        and a row that fails again fails only its own request."""
        outputs: list[StepOutput] = []
        for row in rows:
            try:
                outputs += self._run([row])
            except Exception as exc:
                logger.warning("request %s failed alone: %r", row.req.request_id, exc)
                outputs.append(self.fail(row.req, f"internal engine error ({type(exc).__name__})"))
        return outputs

    def fail(self, req: RequestState, reason: str) -> StepOutput:
        """End one request with an error; its pages and sampler state are freed."""
        self.scheduler.finish(req.request_id)
        self.requests.pop(req.request_id, None)
        self.sampling.release(req)
        return StepOutput(req.request_id, [], FinishReason.ABORT, error=reason)

    def note_canvas_latency(self, seconds: float) -> None:
        """A canvas was committed this step, `seconds` after it started."""
        self._stats.canvas_latencies.append(seconds)

    def _split(self, rows: list[ScheduledRow]) -> tuple[list[ScheduledRow], list[ScheduledRow]]:
        """The DECODE (denoise) and ENCODE rows; newly running requests get their sampler
        state."""
        now = time.monotonic()
        for row in rows:
            if row.req.first_scheduled_time is None:
                row.req.first_scheduled_time = now
                self.sampling.admit(row.req)
        denoise = [row for row in rows if ROW_KINDS[row.kind].decode]
        return denoise, [row for row in rows if not ROW_KINDS[row.kind].decode]

    def _inputs(self, denoise: list[ScheduledRow], encode: list[ScheduledRow]) -> StepInputs:
        canvas_ids: torch.Tensor | None = None
        soft: SoftEmbeds = []
        if denoise:
            now = time.monotonic()
            for row in denoise:
                if not row.req.in_canvas:
                    row.req.canvas_started = now
            canvas_ids, soft = self.sampling.canvas_inputs([row.req for row in denoise])
        pages = [row.req.pages for row in denoise]
        assert all(p is not None for p in pages)
        return StepInputs(
            denoise_starts=[row.start for row in denoise],
            denoise_pages=pages,  # type: ignore[arg-type]
            canvas_ids=canvas_ids,
            soft_embeds=soft,
            encode=[ROW_KINDS[row.kind].encode_input(row) for row in encode],
        )

    def _sample(
        self, denoise: list[ScheduledRow], encode: list[ScheduledRow], out: RunOutput
    ) -> dict[int, RowResult]:
        sampling = [row for row in encode if ROW_KINDS[row.kind].wants_token(row)]
        denoise_reqs, ar_reqs = [row.req for row in denoise], [row.req for row in sampling]
        start = time.perf_counter()
        raw_ar = before_sampling(ar_reqs, out.last_logits)
        masked = time.perf_counter()
        sampled = self.sampling.sample(out.denoise_logits, denoise_reqs, out.last_logits, ar_reqs)
        after = time.perf_counter()
        logprobs = after_sampling(denoise_reqs, ar_reqs, sampled, out.denoise_logits, raw_ar)
        end = time.perf_counter()
        self._stats.sample_seconds += end - start
        self._stats.grammar_seconds += (masked - start) + (end - after)
        return _row_results(denoise, sampling, sampled, logprobs)

    def emit_token(
        self, req: RequestState, token: int, logprob: list[TokenLogprob] | None = None
    ) -> StepOutput:
        """An AR token: the request ends at EOS or at its token budget."""
        reason = None
        if token in req.params.eos_token_ids:
            reason = FinishReason.STOP
        elif len(req.output_ids) + 1 >= req.params.max_tokens:
            reason = FinishReason.LENGTH
        return self.emit(req, [token], reason, logprob)

    def emit(
        self,
        req: RequestState,
        tokens: list[int],
        reason: FinishReason | None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> StepOutput:
        """Append committed tokens; with a finish reason, the request ends here."""
        now = time.monotonic()
        if tokens and req.first_token_time is None:
            req.first_token_time = now
        req.output_ids += tokens
        if reason is None:
            return StepOutput(req.request_id, tokens, logprobs=logprobs)
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
        return StepOutput(req.request_id, tokens, reason, stats=stats, logprobs=logprobs)


def _row_results(
    denoise: list[ScheduledRow],
    sampling: list[ScheduledRow],
    sampled: Sampled,
    logprobs: tuple[dict[int, list[TokenLogprob]], dict[int, TokenLogprob]],
) -> dict[int, RowResult]:
    """The sampler's results keyed by row (its identity)."""
    denoise_lp, ar_lp = logprobs
    results = {
        id(row): RowResult(
            finished=sampled.finished[j],
            num_steps=sampled.num_steps[j],
            draft=sampled.drafts[j],
            failed=sampled.failed[j],
            logprobs=denoise_lp.get(j),
        )
        for j, row in enumerate(denoise)
    }
    for k, row in enumerate(sampling):
        lp = [ar_lp[k]] if k in ar_lp else None
        results[id(row)] = RowResult(
            token=sampled.ar_tokens[k], failed=sampled.ar_failed[k], logprobs=lp
        )
    return results
