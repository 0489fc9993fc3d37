"""Structured outputs and log-probabilities over HTTP: the request fields and their errors, the
response shapes (fake engine), and end to end through the official `openai` client on the tiny
random-weight checkpoint (real engine, both modes, streaming and not, fast and exact)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.fake_engine import EOS

CHAT = [{"role": "user", "content": "hi"}]
MODES = [{"mode": "diffusion"}, {"mode": "ar"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3},
        "sunny": {"type": "boolean"},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "integer"}, "lon": {"type": "integer"}},
            "required": ["lat", "lon"],
        },
    },
    "required": ["city", "sunny", "where"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "maxLength": 12}},
            "required": ["location"],
        },
    },
}


# -- the request fields (fake engine) ----------------------------------------------------------


@pytest.mark.parametrize(
    ("response_format", "schema"),
    [
        ({"type": "json_object"}, {"type": "object"}),
        (JSON_SCHEMA, SCHEMA),
        ({"type": "json_schema", "json_schema": {"name": "any"}}, {}),
        ({"type": "text"}, None),
    ],
)
def test_response_format_sets_the_engines_schema(fake, response_format, schema):
    r = fake.post("/chat/completions", messages=CHAT, response_format=response_format)
    assert r.status_code == 200, r.text
    sent = fake.engine.submitted[-1].params.json_schema
    assert (json.loads(sent) if sent else None) == schema


def test_completions_take_a_response_format_too(fake):
    r = fake.post("/completions", prompt="a", response_format={"type": "json_object"})
    assert r.status_code == 200 and fake.engine.submitted[-1].params.json_schema


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
         "response_format.json_schema.schema"),
        ({"response_format": JSON_SCHEMA, "tools": [TOOL], "tool_choice": "required"},
         "response_format"),
        ({"response_format": JSON_SCHEMA, "reasoning_effort": "high"}, "response_format"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": 1}, "logprobs"),
    ],
)  # fmt: skip
def test_bad_structured_and_logprob_fields_are_400s_naming_them(fake, body, param):
    r = fake.post("/chat/completions", messages=CHAT, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completions_logprobs_are_at_most_5(fake):
    r = fake.post("/completions", prompt="a", logprobs=6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


def test_a_schema_the_engine_refuses_is_a_400_before_the_stream(fake):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    fake.engine.prepare = _refusing  # type: ignore[method-assign]
    r = fake.post("/chat/completions", messages=CHAT, stream=True, response_format=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = fake.post("/chat/completions", messages=CHAT, tools=[TOOL], tool_choice=forced)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


async def _refusing(params):  # type: ignore[no-untyped-def]
    from engine.params import ParamError

    raise ParamError("response_format", "unsupported JSON schema: bogus")


# -- response shapes (fake engine) -------------------------------------------------------------


def test_chat_logprobs_shape(fake):
    r = fake.post("/chat/completions", messages=CHAT, logprobs=True, top_logprobs=3, seed=1)
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for entry in content:
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    plain = fake.post("/chat/completions", messages=CHAT, seed=1).json()["choices"][0]
    assert plain["logprobs"] is None


def test_completion_logprobs_shape_and_offsets(fake):
    r = fake.post("/completions", prompt="a", logprobs=2, max_tokens=40, seed=2)
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 40
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(40)]
    assert lp["text_offset"] == offsets
    assert all(len(top) == 2 for top in lp["top_logprobs"])


def test_logprobs_stop_where_a_stop_string_cuts(fake):
    fake.engine.answer = list(b"hello world, and more") + [EOS]
    r = fake.post("/completions", prompt="a", logprobs=0, stop=[","], max_tokens=30)
    choice = r.json()["choices"][0]
    assert choice["text"] == "hello world"
    assert "".join(choice["logprobs"]["tokens"]) == "hello world"


def test_streamed_logprobs_cover_the_streamed_text(fake):
    fake.engine.answer = list("naïve café ☕ done".encode()) + [EOS]
    chunks = fake.sse("/chat/completions", messages=CHAT, logprobs=True, max_tokens=30)
    text, tokens = "", []
    for chunk in chunks[:-1]:
        for c in chunk["choices"]:
            text += c["delta"].get("content") or ""
            tokens += [e["token"] for e in (c["logprobs"] or {}).get("content", [])]
    assert text == "naïve café ☕ done"
    assert tokens[-1] == "<eos>"  # the end token as the tokenizer spells it, not ""
    assert "".join(tokens[:-1]) == text  # a multi-byte character's bytes add "" then the character


def test_the_end_token_is_spelled_in_logprobs_and_covers_no_text(fake):
    fake.engine.answer = list(b"ok") + [EOS]
    r = fake.post("/completions", prompt="a", logprobs=1, max_tokens=30)
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["o", "k", "<eos>"] and lp["text_offset"] == [0, 1, 2]
    r = fake.post("/chat/completions", messages=CHAT, logprobs=True, max_tokens=30)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["o", "k", "<eos>"]
    assert content[-1]["bytes"] == list(b"<eos>")


# -- end to end through the openai client (tiny checkpoint, real engine) ------------------------


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.v1, api_key="unused", max_retries=0)


def _valid(text: str, schema: dict) -> None:  # type: ignore[type-arg]
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("extra", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate_over_20_seeds(client, extra, stream):
    common = {"model": "tiny", "messages": CHAT, "max_tokens": 100, "temperature": 1.0}
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    # few denoising steps: the grammar, not the model, is under test
    body = {**extra, "max_denoising_steps": 4}
    # choice i samples with seed + i: seeds 0-19 in three requests of the server's largest n
    for seed, n in ((0, 8), (8, 8), (16, 4)):
        r = client.chat.completions.create(
            response_format=JSON_SCHEMA, seed=seed, n=n, stream=stream, extra_body=body, **common
        )
        for chunk in r if stream else [r]:
            for c in chunk.choices:
                key = seed * 10 + c.index
                piece = c.delta.content if stream else c.message.content
                texts[key] = texts.get(key, "") + (piece or "")
                finish[key] = c.finish_reason or finish.get(key, "")
    assert len(texts) == 20 and set(finish.values()) == {"stop"}
    for text in texts.values():
        _valid(text, SCHEMA)


@pytest.mark.parametrize("extra", MODES)
def test_json_object_and_a_small_budget(client, extra):
    common = {"model": "tiny", "messages": CHAT, "seed": 3, "extra_body": extra}
    r = client.chat.completions.create(
        response_format={"type": "json_object"}, max_tokens=60, **common
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    short = client.chat.completions.create(response_format=JSON_SCHEMA, max_tokens=8, **common)
    assert short.choices[0].finish_reason == "length"  # never a cut document called complete


@pytest.mark.parametrize("extra", MODES)
def test_forced_tool_calls_have_valid_arguments(client, extra):
    common = {"model": "tiny", "messages": CHAT, "tools": [TOOL], "extra_body": extra}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, max_tokens=40, seed=1, **common)
    (call,) = r.choices[0].message.tool_calls
    _valid(call.function.arguments, TOOL["function"]["parameters"])  # type: ignore[index]
    required = client.chat.completions.create(
        tool_choice="required", max_tokens=120, seed=2, **common
    )
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        _valid(c.function.arguments, TOOL["function"]["parameters"])  # type: ignore[index]


class NoToolsTemplate:
    """A tokenizer as if its chat template could not render tools (SmolLM2's, the built-in
    default model's, cannot)."""

    template_knows_tools = False

    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> object:
        return getattr(self._tokenizer, name)


@pytest.mark.parametrize("extra", MODES)
def test_a_forced_call_on_a_template_without_tools_is_a_valid_call(
    client, live_server, monkeypatch, extra
):
    monkeypatch.setattr(
        live_server.state, "tokenizer", NoToolsTemplate(live_server.state.tokenizer)
    )
    common = {"model": "tiny", "messages": CHAT, "tools": [TOOL], "extra_body": extra}
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, max_tokens=40, seed=1, **common)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call.function.arguments, TOOL["function"]["parameters"])  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        client.chat.completions.create(tool_choice="auto", max_tokens=40, **common)


@pytest.mark.parametrize("extra", MODES)
def test_logprobs_through_the_client(client, extra):
    common = {"model": "tiny", "messages": CHAT, "max_tokens": 24, "seed": 4, "extra_body": extra}
    r = client.chat.completions.create(logprobs=True, top_logprobs=4, temperature=1.0, **common)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and tops == sorted(tops, reverse=True)
        if entry.logprob >= tops[-1]:  # it ranks within the list, so it is in it
            assert min(abs(entry.logprob - t) for t in tops) < 1e-6
    again = client.chat.completions.create(logprobs=True, top_logprobs=4, temperature=1.0, **common)
    assert [e.logprob for e in again.choices[0].logprobs.content] == [e.logprob for e in content]
    stream = client.completions.create(
        prompt="abc", logprobs=2, stream=True, model="tiny", max_tokens=24, extra_body=extra
    )
    tokens, text = [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs else []
    assert "".join(tokens) == text and len(tokens) == 24


def test_exact_numerics_are_constrained_and_give_logprobs(exact_server):
    exact = openai.OpenAI(base_url=exact_server.v1, api_key="unused", max_retries=0)
    for extra in MODES:
        r = exact.chat.completions.create(
            model="tiny",
            messages=CHAT,
            response_format=JSON_SCHEMA,
            logprobs=True,
            max_tokens=100,
            seed=6,
            extra_body=extra,
        )
        _valid(r.choices[0].message.content, SCHEMA)
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
