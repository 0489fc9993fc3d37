"""What the OpenAI protocol models accept and how a rejection reads: neutral values of
unsupported parameters, JSON types taken as they are, messages that name the right thing, an
OpenAPI schema that agrees with the server, and aborts counted as aborts."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.fake_engine import FakeEngine, make_run

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "neutral",
    [
        {"response_format": {"type": "text"}},
        {"logit_bias": {}},
        {"logprobs": False, "top_p": 1, "presence_penalty": 0},
    ],
)
def test_neutral_values_of_unsupported_parameters_are_accepted(fake, neutral):
    r = fake.post("/chat/completions", messages=CHAT, **neutral)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("field", "value"),
    [("functions", [{"name": "f"}]), ("best_of", 2)],
)
def test_other_values_of_unsupported_parameters_are_rejected_by_name(fake, field, value):
    error = fake.post("/chat/completions", messages=CHAT, **{field: value}).json()["error"]
    assert error["param"] == field and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", True), ("n", True), ("seed", False), ("temperature", True), ("top_p", True)],
)
def test_booleans_are_not_numbers(fake, field, value):
    r = fake.post("/completions", prompt="a", **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_a_prompt_of_the_wrong_type_says_what_a_prompt_may_be(fake):
    error = fake.post("/completions", prompt=5).json()["error"]
    assert error["param"] == "prompt"
    assert "must be a string, a list of strings, a list of token ids" in error["message"]


def test_an_image_part_to_a_model_without_image_input_is_refused_naming_it(fake):
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = fake.post("/chat/completions", messages=[{"role": "user", "content": [image]}])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages.0.content.0.image_url"
    assert "image input is not supported by this model" in error["message"]
    assert "valid string" not in error["message"]


def test_a_nan_temperature_is_not_finite(fake):
    r = fake.client.post(
        "/v1/completions",
        content='{"model": "fake", "prompt": "a", "temperature": NaN}',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "must be a finite number" in r.json()["error"]["message"]


def test_the_openapi_schema_lists_only_the_neutral_values_of_unsupported_parameters(fake):
    schema = fake.client.get("/openapi.json").json()["components"]["schemas"]
    chat = schema["ChatCompletionRequest"]["properties"]
    assert chat["functions"]["enum"] == [None, []]
    assert chat["best_of"]["enum"] == [1]
    assert chat["max_tokens"]["anyOf"][0]["type"] == "integer"


def test_a_stream_closed_mid_answer_counts_as_an_abort():
    async def main() -> float:
        engine = FakeEngine(delay=0.01)
        run = make_run(engine, num_choices=1)
        await run.open()
        stream = run.sse()
        await anext(stream)
        await stream.aclose()
        return run.state.metrics.render(engine.stats).decode()

    assert 'vllm:request_success_total{finished_reason="abort",model_name="fake"} 1.0' in (
        asyncio.run(main())
    )
