"""The series vLLM users' dashboards chart (request sizes, tokens per step, the diffusion
counters) and the HTTP series move as they should, over the fake engine."""

from __future__ import annotations

import asyncio

import pytest

from engine.types import EngineStats, StepStats
from server.metrics import NO_RESPONSE, UNROUTED, HttpMetricsMiddleware, Metrics
from tests.server.conftest import make_fake_server
from tests.server.fake_engine import LIMITS, STEPS_PER_CANVAS

CHAT = [{"role": "user", "content": "hi"}]
OK = 'route="/v1/chat/completions",status="200"'


def test_a_completion_adds_one_to_each_request_size_histogram(fake):
    before = fake.metric("vllm:request_generation_tokens_count")
    r = fake.post("/completions", prompt="abc", max_tokens=6)
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 6)
    assert fake.metric("vllm:request_generation_tokens_count") == before + 1
    assert fake.metric("vllm:request_generation_tokens_sum") == 6
    assert fake.metric("vllm:request_prompt_tokens_count") == 1
    assert fake.metric("vllm:request_prompt_tokens_sum") == 3
    assert fake.metric("vllm:request_prompt_tokens_bucket", 'le="5.0"') == 1
    assert fake.metric("vllm:request_prompt_tokens_bucket", 'le="2.0"') == 0


def test_a_request_a_stop_string_ended_is_counted_in_the_size_histograms(fake):
    fake.post("/completions", prompt="ab", max_tokens=6, stop=["c"])
    assert fake.metric("vllm:request_success_total", 'finished_reason="stop"') == 1
    assert fake.metric("vllm:request_generation_tokens_count") == 1
    assert fake.metric("vllm:request_generation_tokens_sum") == 2  # "ab" before the "c"


def test_the_diffusion_counters_count_each_finished_requests_steps_positions_and_tokens(fake):
    fake.post("/completions", prompt="ab", max_tokens=6)  # two canvases of 4
    fake.post("/completions", prompt="ab", max_tokens=3)  # one
    steps = STEPS_PER_CANVAS * 3
    assert fake.metric("vllm:diffusion_num_denoising_steps_total") == steps
    positions = steps * LIMITS.canvas_length
    assert fake.metric("vllm:diffusion_num_canvas_positions_total") == positions
    assert fake.metric("vllm:diffusion_num_committed_tokens_total") == 9


def test_iteration_tokens_count_the_positions_of_steps_that_ran_the_model(fake):
    fake.engine.step(StepStats(num_rows=2, num_tokens=40, num_committed=4))
    fake.engine.step(StepStats())  # a step that only ended requests: no forward
    assert fake.metric("vllm:iteration_tokens_total_count") == 1
    assert fake.metric("vllm:iteration_tokens_total_sum") == 40
    assert fake.metric("vllm:iteration_tokens_total_bucket", 'le="32.0"') == 0
    assert fake.metric("vllm:iteration_tokens_total_bucket", 'le="64.0"') == 1


def test_steps_run_ahead_and_forwards_dropped_are_counted(fake):
    fake.engine.step(StepStats(num_rows=2, num_tokens=40, ran_ahead=True))
    fake.engine.step(StepStats(num_rows=2, num_tokens=40, dropped_forwards=1))
    fake.engine.step(StepStats(num_rows=2, num_tokens=40, ran_ahead=True))
    assert fake.metric("canvas:steps_run_ahead_total") == 2
    assert fake.metric("canvas:forwards_dropped_total") == 1


def test_responses_are_counted_by_route_template_and_status(fake):
    assert fake.post("/chat/completions", messages=CHAT).status_code == 200
    assert fake.post("/chat/completions", messages=CHAT, temperature=-1).status_code == 400
    assert fake.client.get("/v1/chat/completions").status_code == 405
    assert fake.metric("canvas:http_requests_total", OK) == 1
    assert fake.metric("canvas:http_requests_total", OK.replace("200", "400")) == 1
    assert fake.metric("canvas:http_requests_total", OK.replace("200", "405")) == 1
    route = 'route="/v1/chat/completions"'
    assert fake.metric("canvas:http_request_duration_seconds_count", route) == 3


def test_the_route_label_is_the_template_never_the_raw_path(fake):
    fake.client.get("/playground/secret-name-1234")
    fake.client.get("/no/such/path-5678")
    text = fake.client.get("/metrics").text
    assert "secret-name-1234" not in text and "path-5678" not in text
    assert fake.metric("canvas:http_requests_total", 'route="/playground/{name}"') == 1
    assert fake.metric("canvas:http_requests_total", 'route="unrouted",status="404"') == 1


def test_the_edges_refusals_and_engine_faults_are_counted():
    server = make_fake_server(api_keys=("sekrit",))
    with server.client:
        r = server.post("/chat/completions", messages=CHAT)
        assert r.status_code == 401
        server.engine.fail_after = 0
        auth = {"authorization": "Bearer sekrit"}
        body = {"model": "fake", "messages": CHAT}
        r = server.client.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 500
        assert server.metric("canvas:http_requests_total", 'route="unrouted",status="401"') == 1
        assert server.metric("canvas:http_requests_total", OK.replace("200", "500")) == 1


def test_a_streams_latency_runs_to_its_last_byte(fake):
    fake.engine.delay = 0.05
    fake.sse("/chat/completions", messages=CHAT, max_tokens=8)  # the acceptance, two canvases
    route = 'route="/v1/chat/completions"'
    assert fake.metric("canvas:http_request_duration_seconds_sum", route) >= 0.1


@pytest.mark.parametrize(("healthy", "value"), [(True, 1), (False, 0)])
def test_engine_healthy_is_what_health_reports(fake, healthy, value):
    fake.engine.healthy = healthy
    assert fake.client.get("/health").status_code == (200 if healthy else 503)
    assert fake.metric("canvas:engine_healthy") == value


def test_engine_steps_follow_the_engines_step_count():
    metrics = Metrics("m", canvas_length=4)

    def steps(num_steps: int) -> float:
        stats = EngineStats(True, True, 0, 0, 0, 0.0, num_steps=num_steps)
        line = next(
            line
            for line in metrics.render(stats).decode().splitlines()
            if line.startswith("canvas:engine_steps_total")
        )
        return float(line.rsplit(" ", 1)[1])

    assert [steps(5), steps(5), steps(12)] == [5, 5, 12]


async def _no_response(scope, receive, send) -> None:
    return None  # the client left before the route answered


async def _fault(scope, receive, send) -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize(("app", "status"), [(_no_response, NO_RESPONSE), (_fault, "500")])
def test_a_request_that_ended_without_a_response_is_counted(app, status):
    metrics = Metrics("m", canvas_length=4)
    middleware = HttpMetricsMiddleware(app, metrics.http)

    async def send(message) -> None:
        raise AssertionError("nothing is sent")

    scope = {"type": "http", "path": "/v1/models", "method": "GET"}
    if app is _fault:
        with pytest.raises(RuntimeError, match="boom"):
            asyncio.run(middleware(scope, None, send))
    else:
        asyncio.run(middleware(scope, None, send))
    sample = metrics.registry.get_sample_value(
        "canvas:http_requests_total", {"model_name": "m", "route": UNROUTED, "status": status}
    )
    assert sample == 1
