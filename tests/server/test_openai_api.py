"""The official `openai` client against a live server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams

CHAT = [{"role": "user", "content": "Tell me something."}]
AR = {"mode": "ar"}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.v1, api_key="unused", max_retries=0)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, seed=1)
    choice = r.choices[0]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 20
    assert choice.canvas_stats["decoder_passes"] >= 1


def test_completion_with_n_2_gives_two_seeded_choices(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=20, seed=3, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text
    again = client.completions.create(model="tiny", prompt="hello", max_tokens=20, seed=3, n=2)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_streaming_chat_with_usage_matches_the_non_streamed_answer(client):
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, seed=5)
    stream = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=40,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert 1 <= len(content_chunks) <= 3  # one chunk per committed canvas (16 tokens each)
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [full.choices[0].finish_reason]


def test_streaming_completion(client):
    stream = client.completions.create(
        model="tiny", prompt="abc", max_tokens=24, seed=2, stream=True
    )
    text = "".join(c.choices[0].text for c in stream)
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=24, seed=2)
    assert text == full.choices[0].text


def test_max_tokens_smaller_than_the_canvas_is_exact(client):
    r = client.completions.create(
        model="tiny", prompt="abc", max_tokens=5, seed=9, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_stop_string_inside_a_canvas_cuts_before_it(client):
    base = client.completions.create(
        model="tiny", prompt="xyz", max_tokens=16, seed=4, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = client.completions.create(
        model="tiny",
        prompt="xyz",
        max_tokens=16,
        seed=4,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16


def test_seeded_output_equals_canvas_generate(client, live_server, tiny_checkpoint):
    r = client.completions.create(model="tiny", prompt=[5, 9, 13], max_tokens=30, seed=11)
    llm = LLM.from_pretrained(tiny_checkpoint("c16"))
    (out,) = llm.generate([5, 9, 13], SamplingParams(max_tokens=30, seed=11))
    assert r.choices[0].text == out.text
    assert r.usage.completion_tokens == len(out.output_ids)
    assert r.choices[0].canvas_stats["steps_per_canvas"] == out.steps_per_canvas


def test_ar_mode_over_http(client):
    r = client.completions.create(
        model="tiny", prompt="abc", max_tokens=6, extra_body={"mode": "ar", "ignore_eos": True}
    )
    assert r.usage.completion_tokens == 6
    assert r.choices[0].canvas_stats["decoder_passes"] == 0


def test_stream_drafts_ride_in_an_extra_field(client):
    stream = client.completions.create(
        model="tiny",
        prompt="abc",
        max_tokens=16,
        seed=1,
        stream=True,
        extra_body={"stream_drafts": True},
    )
    chunks = list(stream)
    drafts = [
        c.choices[0].model_extra.get("draft")
        for c in chunks
        if c.choices[0].model_extra.get("draft") is not None
    ]
    text = "".join(c.choices[0].text for c in chunks)
    assert drafts and text  # drafts arrived, content still arrives (append-only)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"temperature": 5}, "temperature", "temperature"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"n": 99}, "n", "n"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
            "names no function",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
            "response_format.json_schema.schema",
            "dictionary",
        ),
        ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias"),
        ({"bogus_field": 1}, "bogus_field", "bogus_field"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
        ({"t_min": 0.9, "t_max": 0.5}, "t_max", "t_max"),
        ({"entropy_bound": -1}, "entropy_bound", "entropy_bound"),
        ({"mode": "beam"}, "mode", "mode"),
        ({"messages": []}, "messages", "messages"),
        ({"max_tokens": "many"}, "max_tokens", "max_tokens"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(live_server, body, param, fragment):
    payload = {"model": "tiny", "messages": CHAT, **body}
    r = httpx.post(f"{live_server.v1}/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"]
    assert err["type"] == "invalid_request_error"


def test_context_length_exceeded(live_server):
    payload = {"model": "tiny", "messages": CHAT, "max_tokens": 100_000}
    r = httpx.post(f"{live_server.v1}/chat/completions", json=payload)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "maximum context length is 8192 tokens" in err["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=CHAT)


def test_malformed_json_and_unknown_routes(live_server):
    r = httpx.post(
        f"{live_server.v1}/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{live_server.v1}/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_bad_prompt_token_is_400(live_server):
    r = httpx.post(f"{live_server.v1}/completions", json={"model": "tiny", "prompt": [5, 999999]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_health_ready_metrics_and_request_id(live_server):
    assert httpx.get(f"{live_server.url}/health").status_code == 200
    assert httpx.get(f"{live_server.url}/ready").json() == {"status": "ready"}
    r = httpx.get(f"{live_server.v1}/models", headers={"x-request-id": "abc123"})
    assert r.headers["x-request-id"] == "abc123"
    text = httpx.get(f"{live_server.url}/metrics").text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_success_total",
        "canvas:steps_per_canvas",
        "canvas:tokens_per_forward",
        "canvas:canvas_latency_seconds",
        "canvas:committed_tokens_per_step",
    ):
        assert name in text, name
    assert httpx.get(f"{live_server.url}/docs").status_code == 200
    assert json.loads(httpx.get(f"{live_server.url}/openapi.json").text)["paths"]


def test_a_repeated_prompt_reports_cached_tokens_on_both_routes_until_the_cache_is_reset(
    cached_server,
):
    live_server = cached_server
    client = openai.OpenAI(base_url=live_server.v1, api_key="unused", max_retries=0)
    prompt = list(range(300, 340))  # 40 token ids no other test sends: 2 full pages reusable
    first = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, seed=1, extra_body=AR
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=2,
        seed=1,
        extra_body=AR,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == 32
    chat = [{"role": "user", "content": "A long question that no other test asks. " * 3}]
    client.chat.completions.create(model="tiny", messages=chat, max_tokens=2, seed=1, extra_body=AR)
    repeat = client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=2, seed=1, extra_body=AR
    )
    assert repeat.usage.prompt_tokens_details.cached_tokens >= 16
    text = httpx.get(f"{live_server.url}/metrics").text
    hits = [line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 32 + 16
    assert "vllm:prefix_cache_queries_total" in text and "canvas:prefix_cache_usage_perc" in text
    reset = httpx.post(f"{live_server.url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["pages_forgotten"] > 0
    after = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, seed=1, extra_body=AR
    )
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.choices[0].text == first.choices[0].text
