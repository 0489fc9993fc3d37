"""One HTTP request: its n choices, each run as an engine request, to a full response or a
stream of SSE chunks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.params import ResolvedParams
from engine.types import FinishReason, RequestStats
from server.errors import ClientGone, to_api_error
from server.render import ChoiceResult, Renderer
from server.state import ServerState, Ticket
from server.stream import DONE, ChoiceEvent, OutputCollector, sse
from server.text import TextStream

logger = logging.getLogger(__name__)
DISCONNECT_POLL_SECONDS = 0.25


@dataclass(slots=True)
class Choice:
    """One choice of a request as it is produced."""

    index: int
    text: TextStream
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    last_output_time: float = field(default_factory=time.monotonic)

    def result(self) -> ChoiceResult:
        return ChoiceResult(
            self.index, self.text.text, self.text.num_tokens, self.finish_reason, self.stats
        )


class RequestRun:
    """Runs the choices of one validated request concurrently as engine requests."""

    def __init__(
        self,
        state: ServerState,
        renderer: Renderer,
        prompt_ids: list[int],
        params: ResolvedParams,
        num_choices: int,
        stop: list[str],
        want_drafts: bool,
    ) -> None:
        self.state, self.renderer = state, renderer
        self.prompt_ids, self.params, self.want_drafts = prompt_ids, params, want_drafts
        tokenizer = state.tokenizer
        self.decode: Callable[[list[int]], str] = tokenizer.decode if tokenizer else _no_text
        self.choices = [Choice(i, TextStream(self.decode, stop)) for i in range(num_choices)]
        self._token_text: dict[int, str] = {}  # token id -> its text alone (draft cells)

    @property
    def response_id(self) -> str:
        return self.renderer.response_id

    def _choice_params(self, index: int) -> ResolvedParams:
        """Choice i samples with seed + i, so n > 1 gives n different, reproducible answers."""
        seed = self.params.seed
        if seed is None or index == 0:
            return self.params
        return replace(self.params, seed=(seed + index) % 2**63)

    async def _run_choice(self, choice: Choice, sink: OutputCollector | None) -> None:
        """Drive one engine request to its end; put what the client should see into `sink`."""
        stream = self.state.engine.generate(
            f"{self.response_id}-{choice.index}",
            self.prompt_ids,
            self._choice_params(choice.index),
            self.want_drafts,
        )
        try:
            async for out in stream:
                delta = choice.text.add(out.new_token_ids, final=out.finish_reason is not None)
                if choice.text.stopped:
                    choice.finish_reason = FinishReason.STOP
                elif out.finish_reason is not None:
                    choice.finish_reason = FinishReason(out.finish_reason)
                    choice.stats = out.stats
                if out.new_token_ids:
                    now = time.monotonic()
                    self.state.metrics.itl.observe(now - choice.last_output_time)
                    choice.last_output_time = now
                if sink is not None and (delta or out.draft is not None or choice.finish_reason):
                    event = ChoiceEvent(
                        choice.index, delta, out.draft, choice.finish_reason, choice.stats
                    )
                    sink.put(event)
                if choice.finish_reason is not None:
                    break
        except asyncio.CancelledError:  # the client went away mid-answer
            self.state.metrics.success(FinishReason.ABORT.value)
            raise
        finally:
            await stream.aclose()  # aborts the engine request if it is still running
        self._record(choice)

    def _record(self, choice: Choice) -> None:
        metrics = self.state.metrics
        if choice.stats is not None:
            reason = choice.finish_reason or FinishReason.STOP
            metrics.on_finish(choice.stats, reason.value, choice.text.num_tokens)
            if choice.stats.first_token_time is not None:
                metrics.ttft.observe(choice.stats.first_token_time - choice.stats.arrival_time)
        elif choice.finish_reason is FinishReason.STOP:  # a stop string ended it
            metrics.success(FinishReason.STOP.value)
            metrics.prompt_tokens.inc(len(self.prompt_ids))
            metrics.generation_tokens.inc(choice.text.num_tokens)

    def _num_completion(self) -> int:
        return sum(c.text.num_tokens for c in self.choices)

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
        return self.renderer.response(results, len(self.prompt_ids))

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
                yield sse(chunk)
            while (events := await sink.get()) is not None:
                for event in events:
                    ids = event.draft_ids
                    draft = self.decode(ids) if ids is not None else None
                    cells = self._cells(ids) if ids is not None else None
                    yield sse(render.chunk(event, draft, cells))
            if render.include_usage:
                yield sse(render.usage_chunk(len(self.prompt_ids), self._num_completion()))
        except Exception as exc:
            logger.warning("request %s failed mid-stream: %s", self.response_id, exc)
            yield sse(to_api_error(exc, self.response_id, render.prompt_param).body())
        finally:
            await _cancel_all(tasks)
        yield DONE


class SSEResponse(StreamingResponse):
    """A run's SSE stream. Its admission ticket is released when the response ends however it
    ends (finished, client gone, or the stream never started), after the run's engine requests
    have ended."""

    def __init__(self, run: RequestRun, ticket: Ticket) -> None:
        self._events = run.sse()
        self._ticket = ticket
        super().__init__(self._events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # a stream left mid-way cancels its choices
            self._ticket.release()


async def _cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel `tasks` and wait until they have ended (their engine requests closed)."""
    for t in tasks:
        t.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.gather(*tasks, return_exceptions=True)


def _no_text(_: list[int]) -> str:
    return ""
