"""Every error the server answers, over the fake engine: the OpenAI envelope, the status, the
parameter it names, and the headers clients act on."""

from __future__ import annotations

import re

import pytest

from engine.params import ParamError
from server.state import HttpLimits
from tests.server.conftest import make_fake_server

CHAT = [{"role": "user", "content": "hi"}]


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"temperature": 5}, "temperature", "temperature: must be in [0, 2]"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens: must be >= 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "must be >= 1"),
        ({"n": 99}, "n", "n: must be in [1, 8]"),
        ({"seed": -1}, "seed", "seed"),
        ({"user": "u" * 257}, "user", "at most 256"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "Missing required parameter"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"top_p": 0}, "top_p", "top_p: must be in (0, 1]"),
        ({"top_p": "NaN"}, "top_p", "top_p"),
        ({"top_k": -2}, "top_k", "top_k: must be -1 or 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty: must be in [-2, 2]"),
        ({"bogus_field": 1}, "bogus_field", "Unrecognized request argument supplied"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings"),
        ({"stop": [""]}, "stop", "1 to 256 characters"),
        ({"t_min": 0.9, "t_max": 0.5}, "t_max", "t_max: must be > t_min"),
        ({"entropy_bound": -1}, "entropy_bound", "entropy_bound"),
        ({"max_denoising_steps": 2000}, "max_denoising_steps", "[1, 1024]"),
        ({"mode": "beam"}, "mode", "mode"),
        ({"messages": []}, "messages", "at least one message"),
        ({"max_tokens": "many"}, "max_tokens", "max_tokens"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(fake, body, param, fragment):
    err = error_of(fake.post("/chat/completions", **{"messages": CHAT, **body}), 400)
    assert err["param"] == param and fragment in err["message"]
    assert err["type"] == "invalid_request_error"
    assert not fake.engine.submitted


def test_context_length_exceeded_uses_the_openai_phrasing(fake):
    err = error_of(fake.post("/completions", prompt=[1, 2, 3], max_tokens=100), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"].startswith(
        "This model's maximum context length is 64 tokens. However, you requested 103 tokens "
        "(3 in the messages, 100 in the completion)."
    )


def test_diffusion_context_counts_whole_canvases(fake):
    err = error_of(fake.post("/completions", prompt=[1] * 62, max_tokens=3), 400)
    assert "you requested 66 tokens (62 in the messages, 4 in the completion)" in err["message"]


def test_a_context_the_kv_cache_cannot_hold_is_400(fake):
    err = error_of(fake.post("/completions", prompt=[1] * 40, max_tokens=12), 400)
    assert err["param"] == "max_tokens" and "do not fit in the KV cache" in err["message"]


def test_prompt_token_outside_the_vocabulary_is_400(fake):
    err = error_of(fake.post("/completions", prompt=[5, 999]), 400)
    assert err["param"] == "prompt" and "token id 999 is outside the vocabulary" in err["message"]


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [([], "must not be empty"), (["a"] * 65, "at most 64 prompts per request")],
)
def test_empty_and_oversized_batches_of_prompts_are_400(fake, prompt, fragment):
    err = error_of(fake.post("/completions", prompt=prompt), 400)
    assert err["param"] == "prompt" and fragment in err["message"]


def test_a_conversation_the_template_refuses_is_400_naming_messages(fake):
    messages = [*CHAT, {"role": "assistant", "content": "hello"}]
    err = error_of(fake.post("/chat/completions", messages=messages), 400)
    assert err["param"] == "messages" and "must end with a user message" in err["message"]


def test_unknown_model_is_404(fake):
    r = fake.client.post("/v1/completions", json={"model": "gpt-9", "prompt": "a"})
    err = error_of(r, 404)
    assert err["code"] == "model_not_found" and "'gpt-9' does not exist" in err["message"]


def test_unknown_route_is_404_and_malformed_json_is_400(fake):
    assert error_of(fake.client.get("/v1/nothing"), 404)["message"] == "Not found: no such route"
    r = fake.client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in error_of(r, 400)["message"]


@pytest.mark.parametrize(
    ("headers", "sent"),
    [
        ({}, "is missing"),
        ({"content-type": "application/x-www-form-urlencoded"}, "was 'application/x-www-form"),
        ({"content-type": "text/plain"}, "was 'text/plain'"),
    ],
)
def test_a_body_not_sent_as_json_is_415_naming_the_header(fake, headers, sent):
    body = b'{"model": "fake", "prompt": "a"}'  # what `curl -d` without -H sends
    r = fake.client.post("/v1/completions", content=body, headers=headers)
    error = r.json()["error"]
    assert r.status_code == 415 and error["param"] == "Content-Type", r.text
    assert "'Content-Type: application/json'" in error["message"] and sent in error["message"]
    assert "dictionary" not in error["message"]  # no pydantic jargon


def test_a_json_body_that_is_not_an_object_is_400_saying_so(fake):
    r = fake.client.post("/v1/chat/completions", json=[1, 2])
    error = r.json()["error"]
    assert r.status_code == 400 and "must be a JSON object" in error["message"], r.text
    ok = {"content-type": "application/json; charset=utf-8"}
    r = fake.client.post("/v1/completions", content=b'{"model": "fake", "prompt": "a"}', headers=ok)
    assert r.status_code == 200, r.text


def test_api_key_guards_v1_but_not_health():
    server = make_fake_server(api_keys=("sekrit",))
    with server.client as client:
        assert error_of(client.get("/v1/models"), 401)["type"] == "authentication_error"
        bad = {"authorization": "Bearer wrong"}
        assert client.get("/v1/models", headers=bad).status_code == 401
        good = {"authorization": "Bearer sekrit"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200


def test_oversized_body_is_413():
    server = make_fake_server(http=HttpLimits(max_body_bytes=100))
    with server.client:
        r = server.post("/completions", prompt="x" * 200)
        assert "exceeds the limit of 100" in error_of(r, 413)["message"]
        assert r.headers["x-request-id"]


@pytest.mark.parametrize(("in_flight", "n"), [(8, 1), (6, 3)])
def test_requests_beyond_the_in_flight_limit_are_429(fake, in_flight, n):
    fake.engine.num_inflight = in_flight
    r = fake.post("/completions", prompt="a", n=n)
    assert error_of(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"
    assert not fake.engine.submitted


def test_a_full_engine_queue_is_429(fake):
    fake.engine.queue_full = True
    r = fake.post("/completions", prompt="a")
    assert error_of(r, 429)["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"


def test_new_requests_are_503_while_draining(fake):
    fake.state.draining = True
    r = fake.post("/completions", prompt="a")
    assert error_of(r, 503)["message"] == "The server is draining"
    assert r.headers["retry-after"] == "5"


def test_an_engine_fault_is_500_naming_the_request(fake):
    fake.engine.fail_after = 0
    r = fake.client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "a"},
        headers={"x-request-id": "req7"},
    )
    err = error_of(r, 500)
    assert err["type"] == "internal_error"
    assert re.fullmatch(
        r"Engine error for request cmpl-[0-9a-f]{32}: internal engine error", err["message"]
    )


def test_a_request_the_engine_refuses_is_400(fake):
    fake.engine.refuse = ParamError("max_tokens", "refused by the engine")
    err = error_of(fake.post("/chat/completions", messages=CHAT), 400)
    assert err["param"] == "max_tokens" and "refused by the engine" in err["message"]
