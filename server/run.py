"""One HTTP request: its n choices, each run as an engine request, to a full response or a
stream of SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.inputs.images import PreparedImage
from engine.params import ResolvedParams
from engine.types import FinishReason, RequestStats, StepOutput, TokenLogprob
from server.errors import ClientGone, to_api_error
from server.logprobs import ShownLogprob, TokenTexts
from server.parsers import MARKUP, OutputParser, Parsed, join_tool_calls
from server.render import ChoiceResult, Renderer, usage
from server.state import ServerState, Ticket
from server.stream import DONE, ChoiceEvent, OutputCollector, sse
from server.text import PLAIN_TEXT, TextOptions, TextStream, without

logger = logging.getLogger(__name__)
DISCONNECT_POLL_SECONDS = 0.25


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a request and the parameters its choices run with."""

    ids: list[int]
    params: ResolvedParams
    images: tuple[PreparedImage, ...] = ()  # whose image tokens `ids` holds


@dataclass(slots=True)
class Choice:
    """One choice of a request as it is produced: its text, and what the chat output parser
    (if any) made of it."""

    index: int
    prompt: Prompt
    seed_offset: int  # choice i of a prompt samples with seed + i
    text: TextStream
    parser: OutputParser | None = None
    parsed: Parsed = field(default_factory=Parsed)
    finish_reason: str | None = None
    stats: RequestStats | None = None
    num_cached: int = 0  # prompt tokens its engine request found in the prefix cache
    last_output_time: float = field(default_factory=time.monotonic)
    texts: TokenTexts | None = None  # set when the request asked for log-probabilities
    received: list[TokenLogprob] = field(default_factory=list)
    shown: list[ShownLogprob] = field(default_factory=list)

    def take_logprobs(self, entries: list[TokenLogprob] | None) -> list[ShownLogprob] | None:
        """The log-probabilities to show for what this output committed (up to a stop
        string's cut); None when the request did not ask for them."""
        if self.texts is None:
            return None
        self.received += entries or []
        upto = min(self.text.num_tokens, len(self.received))
        start = len(self.shown)
        final = self.finish_reason is not None and upto == self.text.num_tokens
        new = self.texts.show(self.text.token_ids, start, self.received[start:upto], final)
        self.shown += new
        return new

    def parse(self, delta: str) -> Parsed:
        """What `delta` (and, once the choice has finished, the rest) adds to the answer."""
        if self.parser is None:
            return Parsed(content=delta)
        parsed = self.parser.feed(delta)
        if self.finish_reason is not None:
            parsed.merge(self.parser.finish())
            called = self.parsed.tool_calls or parsed.tool_calls
            if self.parser.calls_finish and called and self.finish_reason == FinishReason.STOP:
                self.finish_reason = "tool_calls"
        self.parsed.merge(parsed)
        return parsed

    def num_reasoning_tokens(self) -> int:
        if self.parser is None:
            return 0
        spans = self.parser.reasoning_spans
        covering = self.text.tokens_covering
        return sum(covering(end) - covering(start) for start, end in spans)

    def result(self) -> ChoiceResult:
        parsed = self.parsed if self.parser is not None else Parsed(content=self.text.text)
        return ChoiceResult(
            self.index,
            parsed.content,
            self.text.num_tokens,
            self.finish_reason,
            self.stats,
            parsed.reasoning if self.parser is not None and parsed.reasoning else None,
            join_tool_calls(parsed.tool_calls),
            self.num_reasoning_tokens(),
            self.shown if self.texts is not None else None,
        )


class RequestRun:
    """Runs the choices of one validated request concurrently as engine requests."""

    def __init__(
        self,
        state: ServerState,
        renderer: Renderer,
        prompts: list[Prompt],
        num_choices: int,
        stop: list[str],
        want_drafts: bool,
        parser: Callable[[], OutputParser] | None = None,
        options: TextOptions = PLAIN_TEXT,
    ) -> None:
        """`num_choices` choices per prompt (choice index = prompt index * num_choices + i);
        `parser`: a factory of each choice's chat output parser (None: plain text); `options`:
        how tokens become text. The token that ended a choice (a stop token, an EOS) is left
        out of its text unless `options.include_stop_str_in_output`, as vLLM leaves it."""
        self.state, self.renderer, self.want_drafts = state, renderer, want_drafts
        self.prompts = prompts
        tokenizer = state.tokenizer
        self.decode: Callable[[list[int]], str] = tokenizer.decode if tokenizer else _no_text
        parsers = [parser() if parser else None for _ in range(len(prompts) * num_choices)]
        special = tokenizer.special_token_texts if tokenizer else None
        text_decode: Callable[[list[int]], str] = self.decode
        if tokenizer is not None and not options.skip_special_tokens:
            text_decode = partial(tokenizer.decode, skip_special_tokens=False)
        elif tokenizer is not None and parsers[0] is not None and parsers[0].markup:
            text_decode = tokenizer.markup_decoder(MARKUP)  # the parser must see the markup

        def text(params: ResolvedParams) -> TextStream:
            ends = params.eos_token_ids  # a special one is dropped already when skipping them
            hidden = ends - set(special or ()) if options.skip_special_tokens else ends
            if options.include_stop_str_in_output:
                hidden = frozenset()
            return TextStream(
                without(text_decode, hidden), stop, options.include_stop_str_in_output
            )

        self.choices = [
            Choice(
                p * num_choices + i, prompt, i, text(prompt.params), parsers[p * num_choices + i]
            )
            for p, prompt in enumerate(prompts)
            for i in range(num_choices)
        ]
        for choice in self.choices:
            if choice.prompt.params.logprobs is not None:
                choice.texts = TokenTexts(self.decode, special)
        self._token_text: dict[int, str] = {}  # token id -> its text alone (draft cells)
        self._streams: list[AsyncGenerator[StepOutput, None]] = []  # by choice, once opened
        self._firsts: list[StepOutput] = []  # each stream's first output (its acceptance)

    @property
    def response_id(self) -> str:
        return self.renderer.response_id

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        """Per prompt (counted once, as its tokens are), the most of it any of its choices
        found in the prefix cache."""
        best: dict[int, int] = {}
        for c in self.choices:
            key = id(c.prompt)
            best[key] = max(best.get(key, 0), c.num_cached)
        return sum(best.values())

    @staticmethod
    def _choice_params(choice: Choice) -> ResolvedParams:
        """Choice i of a prompt samples with seed + i, so n > 1 gives n different,
        reproducible answers."""
        params, seed = choice.prompt.params, choice.prompt.params.seed
        if seed is None or choice.seed_offset == 0:
            return params
        return replace(params, seed=(seed + choice.seed_offset) % 2**63)

    async def open(self) -> None:
        """Submit every choice and wait until the engine has accepted each (a request's first
        output, empty, comes once the engine thread has queued it). What the engine refuses
        (QueueFull, ParamError, a fault) raises here, before any response starts, after every
        choice is closed (aborted). Call `close` when the response ends, however it ends."""
        self._streams = [
            self.state.engine.generate(
                f"{self.response_id}-{c.index}",
                c.prompt.ids,
                self._choice_params(c),
                self.want_drafts,
                c.prompt.images,
            )
            for c in self.choices
        ]
        try:
            firsts = await asyncio.gather(
                *(anext(s) for s in self._streams), return_exceptions=True
            )
        except BaseException:
            await self.close()
            raise
        for first in firsts:
            if isinstance(first, BaseException):
                await self.close()
                raise first
        self._firsts = [f for f in firsts if isinstance(f, StepOutput)]

    async def close(self) -> None:
        """Close every choice's engine stream (idempotent): one still running is aborted."""
        with anyio.CancelScope(shield=True):
            for stream in self._streams:
                await stream.aclose()

    async def _run_choice(self, choice: Choice, sink: OutputCollector | None) -> None:
        """Drive one opened engine request to its end; put what the client should see into
        `sink`."""
        stream = self._streams[choice.index]
        out: StepOutput | None = self._firsts[choice.index]
        try:
            while out is not None:
                self._take(choice, out, sink)
                if choice.finish_reason is not None:
                    break
                out = await anext(stream, None)
        except asyncio.CancelledError:  # the client went away mid-answer
            self.state.metrics.success(FinishReason.ABORT.value)
            raise
        finally:
            await stream.aclose()  # aborts the engine request if it is still running
        self._record(choice)

    def _take(self, choice: Choice, out: StepOutput, sink: OutputCollector | None) -> None:
        """Fold one engine output into `choice`; put what the client should see into `sink`."""
        if out.num_cached_tokens is not None:
            choice.num_cached = out.num_cached_tokens
        delta = choice.text.add(out.new_token_ids, final=out.finish_reason is not None)
        if choice.text.stopped:
            choice.finish_reason = FinishReason.STOP
        elif out.finish_reason is not None:
            choice.finish_reason = FinishReason(out.finish_reason)
            choice.stats = out.stats
        parsed = choice.parse(delta)
        logprobs = choice.take_logprobs(out.logprobs)
        if out.new_token_ids:
            now = time.monotonic()
            self.state.metrics.itl.observe(now - choice.last_output_time)
            choice.last_output_time = now
        verdict = None
        if out.verified is not None and out.accepted is not None:
            verdict = (out.verified, out.accepted)
        news = parsed or out.draft is not None or choice.finish_reason or logprobs or verdict
        if sink is not None and news:
            event = ChoiceEvent(choice.index, parsed, out.draft, choice.finish_reason, choice.stats)
            event.logprobs, event.verified = logprobs, verdict
            event.num_tokens = choice.text.num_tokens
            sink.put(event)

    def _record(self, choice: Choice) -> None:
        metrics = self.state.metrics
        finish = choice.finish_reason
        reason = FinishReason(finish) if finish not in (None, "tool_calls") else FinishReason.STOP
        if choice.stats is not None:
            metrics.on_finish(choice.stats, reason.value, choice.text.num_tokens)
            if choice.stats.first_token_time is not None:
                metrics.ttft.observe(choice.stats.first_token_time - choice.stats.arrival_time)
        elif finish is not None and reason is FinishReason.STOP:  # a stop string ended it
            metrics.on_stop_string(len(choice.prompt.ids), choice.text.num_tokens)

    async def _watch(self, request: Request, tasks: list[asyncio.Task[None]]) -> bool:
        """Cancel the choices when the client goes away (frees their pages); returns whether
        it did."""
        while not all(t.done() for t in tasks):
            if await request.is_disconnected():
                logger.info("request %s: client disconnected, aborting", self.response_id)
                for t in tasks:
                    t.cancel()
                return True
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        return False

    async def complete(self, request: Request) -> dict[str, Any]:
        """The full response; raises APIError when a choice fails, ClientGone when the client
        disconnected first (its choices aborted). Returns only once every choice's engine
        request has ended."""
        tasks = [asyncio.create_task(self._run_choice(c, None)) for c in self.choices]
        watcher = asyncio.create_task(self._watch(request, tasks))
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled() and watcher.result():
                raise ClientGone(self.response_id) from None
            raise
        except Exception as exc:
            raise to_api_error(exc, self.response_id, self.renderer.prompt_param) from None
        finally:
            watcher.cancel()
            await _cancel_all(tasks)
        results = [c.result() for c in self.choices]
        return self.renderer.response(results, self.num_prompt_tokens, self.num_cached_tokens)

    async def _feed(self, choice: Choice, sink: OutputCollector) -> None:
        try:
            await self._run_choice(choice, sink)
        except Exception as exc:
            sink.fail(exc)
        finally:
            sink.close()

    def _cells(self, draft_ids: list[int]) -> list[str]:
        """A draft's tokens decoded one by one (what the playground draws as cells); memoised,
        since a canvas' drafts share most of their tokens."""
        memo = self._token_text
        return [memo[t] if t in memo else memo.setdefault(t, self.decode([t])) for t in draft_ids]

    async def sse(self) -> AsyncGenerator[str, None]:
        """The SSE stream: every choice's chunks as they come, the usage chunk when asked for,
        an in-band error if a choice fails, then [DONE]. Closing it (client gone) cancels the
        choices, which aborts their engine requests."""
        sink = OutputCollector(len(self.choices))
        tasks = [asyncio.create_task(self._feed(c, sink)) for c in self.choices]
        render = self.renderer
        try:
            for chunk in render.opening_chunks(len(self.choices)):
                yield sse(self._with_usage(chunk, 0))
            while (events := await sink.get()) is not None:
                for event in events:
                    ids = event.draft_ids
                    draft = self.decode(ids) if ids is not None else None
                    cells = self._cells(ids) if ids is not None else None
                    verdict = event.verified
                    verified = None if verdict is None else (self._cells(verdict[0]), verdict[1])
                    chunk = render.chunk(event, draft, cells, verified)
                    yield sse(self._with_usage(chunk, event.num_tokens))
            if render.include_usage:
                results = [c.result() for c in self.choices]
                usage = render.usage_chunk(self.num_prompt_tokens, results, self.num_cached_tokens)
                yield sse(usage)
        except Exception as exc:
            logger.warning("request %s failed mid-stream: %s", self.response_id, exc)
            yield sse(to_api_error(exc, self.response_id, render.prompt_param).body())
        finally:
            await _cancel_all(tasks)
        yield DONE

    def _with_usage(self, chunk: dict[str, Any], num_tokens: int) -> dict[str, Any]:
        """`chunk` with the usage so far when the request asked for continuous usage stats
        (vLLM's: the prompt's tokens and the `num_tokens` its choice has completed)."""
        if self.renderer.continuous_usage:
            chunk["usage"] = usage(self.num_prompt_tokens, num_tokens, self.num_cached_tokens)
        return chunk


class SSEResponse(StreamingResponse):
    """An opened run's SSE stream. Its admission ticket is released when the response ends
    however it ends (finished, client gone, or the stream never started), after the run's
    engine requests have ended."""

    def __init__(self, run: RequestRun, ticket: Ticket) -> None:
        self._run = run
        self._events = run.sse()
        self._ticket = ticket
        super().__init__(self._events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # a stream left mid-way cancels its choices
            await self._run.close()  # the stream never started: its engine requests end here
            self._ticket.release()


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until they have ended (their engine requests closed)."""
    for t in tasks:
        t.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.gather(*tasks, return_exceptions=True)


def _no_text(_: list[int]) -> str:
    return ""
