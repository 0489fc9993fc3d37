"""A fake engine and a byte tokenizer, so server tests run in milliseconds without torch.

`FakeEngine` implements `engine.types.EngineClient` the way the async engine behaves: a
request's first output is its acceptance (empty); then its tokens come out one canvas at a time
(with drafts before each canvas when asked for), cut at the first EOS (kept, finish "stop") or
at `max_tokens` (finish "length"); closing the iterator early aborts the request. What it
answers is deterministic and configurable.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.modes import first_cut
from engine.params import DecodingDefaults, ParamError, ResolvedParams
from engine.types import (
    EngineLimits,
    EngineStats,
    FinishReason,
    QueueFull,
    RequestStats,
    StepListener,
    StepOutput,
    StepStats,
    TokenLogprob,
)

if TYPE_CHECKING:
    from server.run import RequestRun

EOS = 256  # the byte tokenizer's end of sequence; decodes to nothing
VOCAB = 260
STEPS_PER_CANVAS = 3

LIMITS = EngineLimits(
    max_context_positions=64,
    vocab_size=VOCAB,
    canvas_length=4,
    max_num_seqs=4,
    max_inflight=8,
    max_fit_positions=48,  # the KV cache holds less than the context
    numerics="fast",
    kernels="twins",
)
DEFAULTS = DecodingDefaults(max_new_tokens=8, eos_token_ids=(EOS,))


class ByteTokenizer:
    """Token i < 256 is byte i; the chat template is 'role: content\\n' per message, the tools
    (when given) as a first 'tools: [names]' line and the thinking switch as 'think: on|off'.
    Markup is plain text here, so `markup_decoder` is `decode`."""

    template_knows_tools = True
    template_knows_thinking = True

    def __init__(self) -> None:
        self.template_defaults: dict[str, Any] = {}

    @property
    def special_token_texts(self) -> dict[int, str]:
        return {EOS: "<eos>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())  # bytes have no special tokens to add

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if i < 256).decode(errors="replace")
        pieces = [bytes([i]) if i < 256 else self.special_token_texts[i].encode() for i in ids]
        return b"".join(pieces).decode(errors="replace")

    def markup_decoder(self, keep: Collection[str]) -> Callable[[list[int]], str]:
        return self.decode

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if messages and messages[-1]["role"] == "assistant":
            raise ValueError("the conversation must end with a user message")
        lines = [f"tools: {[t['function']['name'] for t in tools]}\n"] if tools else []
        kwargs = {**self.template_defaults, **(template_kwargs or {})}
        if "enable_thinking" in kwargs:
            lines.append(f"think: {'on' if kwargs['enable_thinking'] else 'off'}\n")
        for m in messages:
            calls = [c["function"] for c in m.get("tool_calls") or []]
            lines.append(f"{m['role']}: {m['content'] or ''}{calls or ''}\n")
        return self.encode("".join(lines))


def letters(seed: int | None, count: int = 64) -> list[int]:
    """The default answer: the alphabet, starting at letter `seed`."""
    start = seed or 0
    return [ord("a") + (start + i) % 26 for i in range(count)]


@dataclass(slots=True)
class Submitted:
    request_id: str
    prompt_ids: list[int]
    params: ResolvedParams
    want_drafts: bool
    images: tuple = ()


@dataclass
class FakeEngine:
    """Configure by attribute: `answer` (token ids every request produces; None: `letters` of
    the request's seed), `drafts_per_canvas`, `fail_after` (outputs before a RuntimeError),
    `refuse` (what generate raises instead of accepting the request: a ParamError, or a
    QueueFull as the engine thread's add path raises it), `queue_full` (the engine reports
    itself full and refuses every request), `delay` (seconds per output). Like the async
    engine, it counts a request in flight from its generator's first step and refuses one past
    `max_inflight`."""

    limits: EngineLimits = LIMITS
    answer: list[int] | None = None
    drafts_per_canvas: int = 0
    fail_after: int | None = None
    refuse: Exception | None = None
    queue_full: bool = False
    delay: float = 0.0
    alive: bool = False
    healthy: bool = True
    failure: str = ""  # why the engine stopped for good (`EngineStats.failure`)
    warming_up: bool = False
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_inflight: int = 0
    submitted: list[Submitted] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    failed_all: list[Exception] = field(default_factory=list)
    prefix_cache_resets: int = 0
    num_cached: int = 0  # prompt tokens every request reports found in the prefix cache
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    on_step: list[StepListener] = field(default_factory=list)

    @property
    def stats(self) -> EngineStats:
        full = self.limits.max_inflight if self.queue_full else 0
        return EngineStats(
            alive=self.alive,
            healthy=self.alive and self.healthy and not self.failure,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_inflight=max(self.num_inflight, full),
            kv_usage=self.kv_usage,
            num_steps=0,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            failure=self.failure,
            warming_up=self.warming_up,
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.alive = True

    def shutdown(self, timeout: float = 10.0) -> None:
        self.alive = False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def reset_prefix_cache(self) -> int:
        self.prefix_cache_resets += 1
        return 0

    def fail_all_inflight(self, error: Exception) -> int:
        self.failed_all.append(error)
        return 0

    async def prepare(self, params: ResolvedParams) -> None:
        """Like the engine: a schema that is not a JSON object is refused."""
        if params.json_schema is not None:
            try:
                ok = isinstance(json.loads(params.json_schema), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise ParamError("response_format", "invalid JSON schema")

    def step(self, step: StepStats) -> None:
        """Run the step listeners as the engine thread does after a step."""
        for listener in self.on_step:
            listener(step, [])

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: ResolvedParams,
        want_drafts: bool = False,
        images: tuple = (),
    ) -> AsyncIterator[StepOutput]:
        if self.queue_full or self.num_inflight >= self.limits.max_inflight:
            raise QueueFull(f"{self.num_inflight} requests in flight")
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(
            Submitted(request_id, list(prompt_ids), params, want_drafts, tuple(images))
        )
        self.num_inflight += 1
        finished = False
        try:
            yield StepOutput(request_id, [])  # accepted
            async for out in self._outputs(request_id, prompt_ids, params, want_drafts):
                finished = out.finish_reason is not None
                yield out
        finally:
            self.num_inflight -= 1
            if not finished:
                self.abort(request_id)

    async def _outputs(
        self, request_id: str, prompt_ids: list[int], params: ResolvedParams, want_drafts: bool
    ) -> AsyncIterator[StepOutput]:
        tokens = self.answer if self.answer is not None else letters(params.seed)
        canvas, produced, num_outputs, arrival = self.limits.canvas_length, 0, 0, 0.0
        while True:
            for step in range(self.drafts_per_canvas if want_drafts else 0):
                yield await self._pace(StepOutput(request_id, [], draft=[ord("0") + step] * canvas))
            committed = tokens[produced : produced + canvas]
            cut, reason = first_cut(committed, params.max_tokens - produced, params.eos_token_ids)
            produced += len(cut)
            num_outputs += 1
            if self.fail_after is not None and num_outputs > self.fail_after:
                raise RuntimeError("internal engine error")
            if reason is None and produced >= len(tokens):
                reason = FinishReason.LENGTH  # the answer ran out
            stats = None
            if reason is not None:
                num_canvases = -(-produced // canvas)
                stats = RequestStats(
                    num_prompt_tokens=len(prompt_ids),
                    num_output_tokens=produced,
                    decoder_passes=STEPS_PER_CANVAS * num_canvases,
                    encoder_passes=1 + num_canvases,
                    steps_per_canvas=(STEPS_PER_CANVAS,) * num_canvases,
                    arrival_time=arrival,
                    first_scheduled_time=arrival + 0.5,
                    first_token_time=arrival + 1.0,
                    finish_time=arrival + 2.0,
                )
            logprobs = _logprobs(cut, params.logprobs) if params.logprobs is not None else None
            out = StepOutput(request_id, cut, reason, stats=stats, logprobs=logprobs)
            yield await self._pace(replace(out, num_cached_tokens=self.num_cached))
            if reason is not None:
                return

    async def _pace(self, out: StepOutput) -> StepOutput:
        await asyncio.sleep(self.delay)
        return out


def _logprobs(tokens: list[int], top: int) -> list[TokenLogprob]:
    """Made-up but well-formed log-probabilities: the token ranks first, then its neighbours."""
    return [
        TokenLogprob(t, -0.5, tuple(((t + k) % 256, -0.5 - k) for k in range(top))) for t in tokens
    ]


def make_run(engine: FakeEngine, num_choices: int, max_tokens: int = 40) -> RequestRun:
    """A completion `RequestRun` of one prompt over `engine`, `num_choices` choices (the
    streaming tests drive its SSE directly)."""
    from engine.params import SamplingParams
    from engine.validation import RequestValidator
    from server.render import CompletionRenderer
    from server.run import Prompt, RequestRun  # noqa: F811  (the annotation's, at run time)
    from server.state import ServerState

    state = ServerState(engine, ByteTokenizer(), DEFAULTS, "fake")  # type: ignore[arg-type]
    params = RequestValidator(DEFAULTS, LIMITS).resolve(
        1, SamplingParams(max_tokens=max_tokens, seed=0)
    )
    renderer = CompletionRenderer("x", "fake", include_usage=False)
    return RequestRun(state, renderer, [Prompt([1], params)], num_choices, [], want_drafts=False)
