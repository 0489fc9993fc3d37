"""Prometheus metrics.

Standard serving metrics use vLLM's names (`vllm:` prefix, label `model_name`) because routers
and autoscalers (Gateway API Inference Extension, llm-d, KEDA) are configured for them; the
diffusion-specific ones use the `canvas:` prefix, as do the HTTP series
(`HttpMetricsMiddleware`). The dashboard and alert rules in deploy/ query only these series
(tests/server/test_metrics_dashboard.py checks that).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.types import EngineStats, RequestStats, StepOutput, StepStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
STEP_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
TPF_BUCKETS = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 255)
TOKEN_BUCKETS = (0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Request sizes in tokens, vLLM's 1-2-5 series (it stops at the context length; these at 10^6).
REQUEST_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))[:-2]
UNROUTED = "unrouted"  # the route label of a request no route took
NO_RESPONSE = "499"  # the status label of a request that ended before its response began


class PrefixCacheMetrics:
    """vLLM's prefix-cache counters, in tokens (hit rate = hits / queries), fed from the
    engine's running totals, and the share of pages cached and idle."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            labels,
            registry=registry,
        ).labels(model_name)
        self.hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            labels,
            registry=registry,
        ).labels(model_name)
        self.usage = Gauge(
            "canvas:prefix_cache_usage_perc",
            "Fraction of KV cache pages cached and idle, reclaimable on demand (0..1)",
            labels,
            registry=registry,
        ).labels(model_name)
        self._seen = (0, 0)  # the engine's totals at the last update

    def update(self, engine: EngineStats) -> None:
        queries, hits = engine.prefix_cache_queries, engine.prefix_cache_hits
        seen_queries, seen_hits = self._seen
        self.queries.inc(max(0, queries - seen_queries))
        self.hits.inc(max(0, hits - seen_hits))
        self._seen = (max(queries, seen_queries), max(hits, seen_hits))
        self.usage.set(engine.prefix_cache_usage)


class EngineLoopMetrics:
    """The step loop: whether it is healthy (what /health answers), the steps it has run (fed
    from the engine's running total), each step's times, and vLLM's token positions per step."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(
                model_name
            )

        self.healthy = Gauge(
            "canvas:engine_healthy",
            "1 while the step loop is alive and stepping whenever there is work, else 0",
            labels,
            registry=registry,
        ).labels(model_name)
        self.steps = Counter(
            "canvas:engine_steps", "Engine steps run", labels, registry=registry
        ).labels(model_name)
        self._seen_steps = 0  # the engine's step count at the last update
        self.ran_ahead = Counter(
            "canvas:steps_run_ahead",
            "Steps whose forward ran beside the last step's update (--overlap)",
            labels,
            registry=registry,
        ).labels(model_name)
        self.dropped = Counter(
            "canvas:forwards_dropped",
            "Forwards run ahead and dropped: the step's plan had other rows (--overlap)",
            labels,
            registry=registry,
        ).labels(model_name)
        self.step_seconds = hist("canvas:step_seconds", "Engine step wall time", LATENCY_BUCKETS)
        self.sample_seconds = hist(
            "canvas:sample_seconds",
            "Sampler time per step (the sampling arithmetic, then its one host transfer)",
            LATENCY_BUCKETS,
        )
        self.forward_seconds = hist(
            "canvas:forward_seconds", "Model forward time per step", LATENCY_BUCKETS
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Token positions per engine step that ran the model",
            TOKEN_BUCKETS,
        )

    def on_step(self, step: StepStats) -> None:
        self.step_seconds.observe(step.step_seconds)
        self.forward_seconds.observe(step.forward_seconds)
        self.sample_seconds.observe(step.sample_seconds)
        if step.num_tokens:  # a step that ran the model
            self.iteration_tokens.observe(step.num_tokens)
        self.ran_ahead.inc(step.ran_ahead)
        self.dropped.inc(step.dropped_forwards)

    def update(self, engine: EngineStats) -> None:
        self.healthy.set(1 if engine.healthy else 0)
        self.steps.inc(max(0, engine.num_steps - self._seen_steps))
        self._seen_steps = max(engine.num_steps, self._seen_steps)


class RequestSizes:
    """vLLM's request-size histograms: prompt and generated tokens per finished request."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def hist(name: str, doc: str) -> Any:
            return Histogram(
                name, doc, ["model_name"], buckets=REQUEST_TOKEN_BUCKETS, registry=registry
            ).labels(model_name)

        self.prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per finished request")
        self.generation = hist(
            "vllm:request_generation_tokens", "Generated tokens per finished request"
        )

    def observe(self, num_prompt_tokens: int, num_generated: int) -> None:
        self.prompt.observe(num_prompt_tokens)
        self.generation.observe(num_generated)


class DiffusionCounters:
    """vLLM's diffusion counters: denoising steps run (decoder passes over a canvas), the canvas
    positions those steps evaluated (canvas length each), and the tokens committed. Fed per
    finished request: only its stats tell denoising passes from encoder passes. Committed
    tokens / denoising steps is the tokens per denoising step (AR mode runs none)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, canvas_length: int) -> None:
        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        self.canvas_length = canvas_length
        self.steps = counter("vllm:diffusion_num_denoising_steps", "Denoising steps run")
        self.positions = counter(
            "vllm:diffusion_num_canvas_positions", "Canvas positions the denoising steps evaluated"
        )
        self.committed = counter(
            "vllm:diffusion_num_committed_tokens", "Tokens committed (finalized) by the engine"
        )

    def on_finish(self, stats: RequestStats) -> None:
        self.steps.inc(stats.decoder_passes)
        self.positions.inc(stats.decoder_passes * self.canvas_length)
        self.committed.inc(stats.num_output_tokens)


class HttpMetrics:
    """Responses by route template and status code, and their latency by route (from the
    request's arrival to the response's last byte: a stream's whole length)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.requests = Counter(
            "canvas:http_requests",
            "HTTP responses by route template and status code",
            ["model_name", "route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "canvas:http_request_duration_seconds",
            "HTTP request latency by route template, to the response's last byte",
            ["model_name", "route"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def record(self, route: str, status: str, seconds: float) -> None:
        self.requests.labels(self.model_name, route, status).inc()
        self.duration.labels(self.model_name, route).observe(seconds)


class HttpMetricsMiddleware:
    """Records every HTTP request in `HttpMetrics`, labelled by the path template of the route
    the router dispatched it to (`scope["route"]`, which the router sets: `/playground/{name}`,
    a method mismatch included), never the raw path, so no client can grow the label
    set; a request no route took (a path no route matches, or one the edge refused before
    routing: 401, 413, ...) is `UNROUTED`. Outermost, it also counts the edge's refusals and
    last-resort 500s; a request that ended before any response (the client left) counts as
    `NO_RESPONSE`, one that raised before any response as 500 (the exception goes on)."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = NO_RESPONSE

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = "500" if status == NO_RESPONSE else status
            raise
        finally:
            route = str(getattr(scope.get("route"), "path", UNROUTED))
            self.metrics.record(route, status, time.monotonic() - start)


def thread_steps_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "canvas:cpu_thread_steps",
        "Engine steps run with each CPU thread count (--threads auto measures, then picks)",
        ["model_name", "threads"],
        registry=registry,
    )


class Metrics:
    def __init__(self, model_name: str, canvas_length: int) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the engine's running set")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1)"
        )
        self.prefix_cache = PrefixCacheMetrics(r, model_name)
        self.slots_used = gauge(
            "canvas:sampler_slots_used", "Sampler slots held (one per running request)"
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self._success = Counter(
            "vllm:request_success",
            "Finished requests",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (Canvas reserves pages: 0)")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Time between streamed chunks", LATENCY_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency", LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time waiting before the first step", LATENCY_BUCKETS
        )
        self.steps_per_canvas = hist(
            "canvas:steps_per_canvas", "Denoising steps per committed canvas", STEP_BUCKETS
        )
        self.tokens_per_forward = hist(
            "canvas:tokens_per_forward",
            "Generated tokens per decoder pass, per request",
            TPF_BUCKETS,
        )
        self.canvas_latency = hist(
            "canvas:canvas_latency_seconds",
            "Time from a canvas' first step to its commit",
            LATENCY_BUCKETS,
        )
        self.committed_per_step = hist(
            "canvas:committed_tokens_per_step", "Tokens committed by one engine step", TOKEN_BUCKETS
        )
        self.positions = counter(
            "canvas:positions_evaluated", "Token positions run through the model"
        )
        # Hybrid mode: acceptance rate = hybrid_accepted_tokens_sum / hybrid_drafted_tokens.
        self.accepted = hist(
            "canvas:hybrid_accepted_tokens",
            "Draft tokens the verifier accepted, per hybrid verify pass",
            ACCEPTED_BUCKETS,
        )
        self.drafted = counter(
            "canvas:hybrid_drafted_tokens", "Draft tokens offered to hybrid verify passes"
        )
        self._thread_steps = thread_steps_counter(r)
        self.engine = EngineLoopMetrics(r, model_name)
        self.request_sizes = RequestSizes(r, model_name)
        self.diffusion = DiffusionCounters(r, model_name, canvas_length)
        self.http = HttpMetrics(r, model_name)

    def success(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def on_step(self, step: StepStats, outputs: list[StepOutput]) -> None:
        """Step-level metrics, called on the engine thread after each step."""
        self.committed_per_step.observe(step.num_committed)
        self.engine.on_step(step)
        self.positions.inc(step.num_tokens)
        for latency in step.canvas_latencies:
            self.canvas_latency.observe(latency)
        for accepted in step.accepted_lengths:
            self.accepted.observe(accepted)
        self.drafted.inc(step.num_drafted)
        if step.cpu_threads:
            self._thread_steps.labels(self.model_name, str(step.cpu_threads)).inc()

    def on_finish(self, stats: RequestStats, reason: str, num_tokens: int) -> None:
        self.success(reason)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self.request_sizes.observe(stats.num_prompt_tokens, num_tokens)
        self.diffusion.on_finish(stats)
        self.e2e.observe(stats.finish_time - stats.arrival_time)
        if stats.first_scheduled_time is not None:
            self.queue_time.observe(stats.first_scheduled_time - stats.arrival_time)
        for steps in stats.steps_per_canvas:
            self.steps_per_canvas.observe(steps)
        if stats.decoder_passes:
            self.tokens_per_forward.observe(stats.tokens_per_forward)

    def on_stop_string(self, num_prompt_tokens: int, num_tokens: int) -> None:
        """A request that a stop string ended: its engine request was aborted, so it has no
        engine stats, only its token counts."""
        self.success("stop")
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_tokens)
        self.request_sizes.observe(num_prompt_tokens, num_tokens)

    def render(self, engine: EngineStats) -> bytes:
        """The exposition text, with the gauges set from an engine snapshot."""
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        self.slots_used.set(engine.num_slots_used)
        self.prefix_cache.update(engine)
        self.engine.update(engine)
        return generate_latest(self.registry)
