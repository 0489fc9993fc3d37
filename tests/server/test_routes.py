"""Every route over the fake engine: answers, parameter mapping, health, metrics, version."""

from __future__ import annotations

import re

import httpx
import pytest

from engine.params import DecodeMode
from engine.types import StepStats
from tests.server.fake_engine import EOS

CHAT = [{"role": "user", "content": "hi"}]


def test_models_lists_the_served_name(fake):
    r = fake.client.get("/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["fake"]


def test_completion_returns_the_engines_tokens_as_text(fake):
    r = fake.post("/completions", prompt="hi", max_tokens=6)
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == "abcdef" and choice["finish_reason"] == "length"
    assert choice["canvas_stats"]["steps_per_canvas"] == [3, 3]
    assert body["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 6,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completions_default_to_sixteen_tokens(fake):
    assert fake.post("/completions", prompt="hi").json()["usage"]["completion_tokens"] == 16


def test_prompt_token_ids_reach_the_engine_unchanged(fake):
    fake.post("/completions", prompt=[5, 9, 13], max_tokens=2)
    assert fake.engine.submitted[0].prompt_ids == [5, 9, 13]


def test_chat_completion_uses_the_template_and_the_checkpoint_budget(fake):
    body = fake.post("/chat/completions", messages=CHAT).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abcdefgh"}
    assert fake.engine.submitted[0].prompt_ids == list(b"user: hi\n")
    assert body["usage"]["completion_tokens"] == 8  # DecodingDefaults.max_new_tokens


def test_max_completion_tokens_wins_over_max_tokens(fake):
    body = fake.post("/chat/completions", messages=CHAT, max_tokens=7, max_completion_tokens=3)
    assert body.json()["choices"][0]["message"]["content"] == "abc"


def test_eos_ends_the_choice_with_stop(fake):
    fake.engine.answer = [ord("h"), ord("i"), EOS, ord("x")]
    body = fake.post("/completions", prompt="a", max_tokens=8).json()
    assert body["choices"][0]["text"] == "hi" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3  # the EOS token counts, as the engine's


def test_ignore_eos_runs_to_max_tokens(fake):
    fake.engine.answer = [ord("h"), EOS] * 8
    body = fake.post("/completions", prompt="a", max_tokens=6, ignore_eos=True).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert fake.engine.submitted[0].params.eos_token_ids == frozenset()


def test_n_choices_use_consecutive_seeds(fake):
    body = fake.post("/completions", prompt="a", max_tokens=3, n=3, seed=5).json()
    assert [s.params.seed for s in fake.engine.submitted] == [5, 6, 7]
    assert [c["text"] for c in body["choices"]] == ["fgh", "ghi", "hij"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 9


def test_stop_string_cuts_inside_a_canvas_and_aborts_the_engine_request(fake):
    body = fake.post("/completions", prompt="a", max_tokens=12, stop=["f"]).json()
    (choice,) = body["choices"]
    assert choice["text"] == "abcde" and choice["finish_reason"] == "stop"
    assert choice["canvas_stats"] is None  # the engine did not finish it
    assert body["usage"]["completion_tokens"] == 5
    assert fake.engine.aborted == [fake.engine.submitted[0].request_id]


def test_http_temperature_scales_the_diffusion_schedule(fake):
    fake.post("/completions", prompt="a", max_tokens=2, temperature=0.5)
    params = fake.engine.submitted[0].params
    assert (params.t_min, params.t_max, params.temperature) == (0.2, 0.4, 0.0)


def test_http_temperature_is_the_sampling_temperature_in_ar_mode(fake):
    fake.post("/completions", prompt="a", max_tokens=2, temperature=0.7, mode="ar")
    params = fake.engine.submitted[0].params
    assert params.mode is DecodeMode.AR
    assert (params.t_min, params.t_max, params.temperature) == (0.4, 0.8, 0.7)


def test_drafts_are_only_asked_of_the_engine_for_streams(fake):
    fake.post("/completions", prompt="a", max_tokens=2, stream_drafts=True)
    assert fake.engine.submitted[0].want_drafts is False


def test_health_follows_the_engine(fake):
    assert fake.client.get("/health").json() == {"status": "ok"}
    fake.engine.healthy = False
    r = fake.client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "unhealthy"}


def test_ready_is_503_while_draining(fake):
    assert fake.client.get("/ready").json() == {"status": "ready"}
    fake.state.draining = True
    r = fake.client.get("/ready")
    assert r.status_code == 503 and r.json() == {"status": "draining"}


def test_gauges_come_from_the_engine_stats(fake):
    fake.engine.num_running, fake.engine.num_waiting, fake.engine.kv_usage = 3, 2, 0.25
    assert fake.metric("vllm:num_requests_running") == 3
    assert fake.metric("vllm:num_requests_waiting") == 2
    assert fake.metric("vllm:kv_cache_usage_perc") == 0.25


def test_prefix_cache_counters_follow_the_engines_totals(fake):
    fake.engine.prefix_cache_queries, fake.engine.prefix_cache_hits = 100, 40
    assert fake.metric("vllm:prefix_cache_queries_total") == 100
    assert fake.metric("vllm:prefix_cache_hits_total") == 40
    fake.engine.prefix_cache_queries, fake.engine.prefix_cache_hits = 130, 40
    assert fake.metric("vllm:prefix_cache_queries_total") == 130
    assert fake.metric("canvas:prefix_cache_usage_perc") == 0.0


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_reported_once_per_prompt_on_both_routes(fake, path, stream):
    fake.engine.num_cached = 3
    prompt = {"prompt": "abcdef"} if path == "/completions" else {"messages": CHAT}
    body = {**prompt, "max_tokens": 4, "n": 2}
    if stream:
        *_, usage, _ = fake.sse(path, stream_options={"include_usage": True}, **body)
    else:
        usage = fake.post(path, **body).json()
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


def test_reset_prefix_cache_reaches_the_engine(fake):
    r = fake.client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"status": "ok", "pages_forgotten": 0}
    assert fake.engine.prefix_cache_resets == 1


def test_step_listeners_feed_the_step_metrics(fake):
    fake.engine.step(StepStats(num_rows=2, num_tokens=10, num_committed=4, canvas_latencies=[0.1]))
    assert fake.metric("canvas:positions_evaluated_total") == 10
    assert fake.metric("canvas:canvas_latency_seconds_count") == 1


@pytest.mark.parametrize(("stop", "reason"), [(None, "length"), (["c"], "stop")])
def test_finished_requests_are_counted_by_reason(fake, stop, reason):
    fake.post("/completions", prompt="ab", max_tokens=6, stop=stop)
    assert fake.metric("vllm:request_success_total", f'finished_reason="{reason}"') == 1
    assert fake.metric("vllm:prompt_tokens_total") == 2
    assert fake.metric("vllm:generation_tokens_total") == (6 if stop is None else 2)


def test_version_reports_the_engines_numerics_and_kernels(fake):
    assert fake.client.get("/version").json() == {
        "version": "0.1.0",
        "numerics": "fast",
        "kernels": "twins",
        "prefix_caching": False,
    }


def test_request_id_is_echoed_but_the_server_names_the_response_and_the_engine_request(fake):
    def post() -> httpx.Response:
        return fake.client.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "a", "max_tokens": 1},
            headers={"x-request-id": "abc123"},
        )

    first, second = post(), post()  # the same client id twice
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "abc123"
    ids = [r.json()["id"] for r in (first, second)]
    assert ids[0] != ids[1] and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)
    assert [s.request_id for s in fake.engine.submitted] == [f"{i}-0" for i in ids]


@pytest.mark.parametrize("bad", ["x" * 129, "a b", "semi;colon", ""])
def test_a_malformed_request_id_is_400_naming_the_header(fake, bad):
    r = fake.client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "a", "max_tokens": 1},
        headers={"x-request-id": bad},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "x-request-id" and "128 characters" in err["message"]
    assert r.headers["x-request-id"] != bad and not fake.engine.submitted
