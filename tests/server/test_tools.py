"""Tool calling, thinking and content parts over HTTP, with a fake engine that answers with
recorded Gemma 4-format outputs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest

from tests.server.conftest import FakeServer, make_fake_server
from tests.server.fake_engine import EOS, LIMITS, ByteTokenizer, FakeEngine
from tests.server.parser_samples import THINK_THEN_CALLS, THOUGHT_AND_ANSWER

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius"]}},
            "required": ["location"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in SF and Tokyo?"}]


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    """A fake server with room for the recorded answers (hundreds of bytes)."""
    limits = replace(LIMITS, max_context_positions=4096, max_fit_positions=4096)
    server = make_fake_server(FakeEngine(limits=limits))
    with server.client:
        yield server


def answer(fake, text: str) -> None:
    fake.engine.answer = list(text.encode()) + [EOS]


def chat(fake, **body):
    r = fake.post("/chat/completions", **{"messages": ASK, "max_tokens": 300, **body})
    assert r.status_code == 200, r.text
    return r.json()


def error(fake, **body) -> dict:
    r = fake.post("/chat/completions", **{"messages": ASK, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_tool_calls_and_thoughts_are_parsed_out_of_the_answer(fake):
    answer(fake, THINK_THEN_CALLS)
    body = chat(fake, tools=[WEATHER])
    (choice,) = body["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] is None
    assert message["reasoning_content"].startswith("The user wants the weather")
    arguments = [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]]
    assert arguments == [
        {"location": "San Francisco, CA", "unit": "celsius"},
        {"location": "Tokyo", "unit": "celsius"},
    ]
    assert all(
        c["type"] == "function" and c["id"].startswith("call_") for c in message["tool_calls"]
    )
    thought = THINK_THEN_CALLS.index("<channel|>") + len("<channel|>")  # one token per byte
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == thought


def test_streamed_tool_calls_and_reasoning_add_up_to_the_full_answer(fake):
    answer(fake, THINK_THEN_CALLS)
    full = chat(fake, tools=[WEATHER])["choices"][0]
    chunks = fake.sse("/chat/completions", messages=ASK, max_tokens=300, tools=[WEATHER])
    deltas = [c["choices"][0] for c in chunks[:-1] if c["choices"]]
    reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
    assert reasoning == full["message"]["reasoning_content"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == ""
    pieces = [p for d in deltas for p in d["delta"].get("tool_calls", [])]
    assert [p["index"] for p in pieces] == [0, 1]
    assert [p["function"]["arguments"] for p in pieces] == [
        c["function"]["arguments"] for c in full["message"]["tool_calls"]
    ]
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]


def test_without_tools_call_markup_stays_content_but_thoughts_are_still_split(fake):
    answer(fake, THINK_THEN_CALLS)
    message = chat(fake)["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"].startswith("<|tool_call>call:")
    answer(fake, THOUGHT_AND_ANSWER)
    choice = chat(fake, tools=[WEATHER], tool_choice="none")["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "2 + 2 = 4.",
        "reasoning": "Simple arithmetic.",
        "reasoning_content": "Simple arithmetic.",
    }
    assert choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(fake):
    answer(fake, THINK_THEN_CALLS)
    message = chat(fake, tools=[WEATHER], parallel_tool_calls=False)["choices"][0]["message"]
    assert len(message["tool_calls"]) == 1


def test_a_named_tool_choice_constrains_to_its_parameters_and_returns_one_call(fake):
    answer(fake, '{"location": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(fake, tools=[WEATHER, TIME], tool_choice=named)["choices"][0]
    schema = json.loads(fake.engine.submitted[-1].params.json_schema)
    assert schema == WEATHER["function"]["parameters"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"location": "Paris"}'}
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    chunks = fake.sse(
        "/chat/completions", messages=ASK, max_tokens=300, tools=[WEATHER], tool_choice=named
    )
    pieces = [
        p for c in chunks[:-1] for x in c["choices"] for p in x["delta"].get("tool_calls", [])
    ]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"location": "Paris"}'
    chat(fake, tools=[TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(fake.engine.submitted[-1].params.json_schema) == {"type": "object"}


def test_required_tool_choice_asks_for_an_array_of_calls(fake):
    answer(fake, '[{"name": "get_time", "arguments": {}}]')
    choice = chat(fake, tools=[WEATHER, TIME], tool_choice="required")["choices"][0]
    schema = json.loads(fake.engine.submitted[-1].params.json_schema)
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert names == ["get_weather", "get_time"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    chat(fake, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(fake.engine.submitted[-1].params.json_schema)["maxItems"] == 1


def test_free_requests_carry_no_schema(fake):
    chat(fake, tools=[WEATHER])
    assert fake.engine.submitted[-1].params.json_schema is None


def test_history_tool_calls_and_tool_messages_reach_the_template(fake):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"location": "SF"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    chat(fake, messages=messages, tools=[WEATHER])
    prompt = bytes(fake.engine.submitted[-1].prompt_ids).decode()
    assert prompt.startswith("tools: ['get_weather']\n")
    assert "assistant: [{'name': 'get_weather', 'arguments': {'location': 'SF'}}]\n" in prompt
    assert prompt.endswith("tool: sunny\n")


@pytest.mark.parametrize(
    ("body", "switch"),
    [
        ({"reasoning_effort": "high"}, "think: on"),
        ({"reasoning_effort": "none"}, "think: off"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "think: on"),
        ({"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "none"}, "off"),
    ],
)
def test_the_thinking_switch_reaches_the_template(fake, body, switch):
    chat(fake, **body)
    assert switch in bytes(fake.engine.submitted[-1].prompt_ids).decode()


def test_content_parts_are_joined_by_newlines(fake):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    chat(fake, messages=[{"role": "system", "content": parts}, {"role": "user", "content": parts}])
    assert bytes(fake.engine.submitted[-1].prompt_ids).decode() == (
        "system: first\nsecond\nuser: first\nsecond\n"
    )


NAMED_OTHER = {"type": "function", "function": {"name": "nope"}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
IMAGE = {"type": "image_url", "image_url": {"url": "x"}}


def function(**fields) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", **fields}}]}


def user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


def then(*messages) -> dict:
    return {"messages": [*ASK, *messages]}


ASSISTANT_BAD_ARGS = {
    "messages": [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
        }
    ]
}


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (
            {"tools": [WEATHER], "tool_choice": NAMED_OTHER},
            "tool_choice.function.name",
            "get_weather",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "Invalid value"),
        (function(name="a b"), "tools.0.function.name", "letters"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "defined twice"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "Invalid value"),
        (function(parameters={"type": "string"}), "tools.0.function.parameters.type", "'object'"),
        (function(parameters={"required": "x"}), "tools.0.function.parameters.required", "names"),
        (function(parameters={"properties": [1]}), "tools.0.function.parameters.properties", "map"),
        ({"chat_template_kwargs": {"x": True}}, "chat_template_kwargs.x", "only 'enable_thinking'"),
        (
            {"chat_template_kwargs": {"enable_thinking": 1}},
            "chat_template_kwargs.enable_thinking",
            "boolean",
        ),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "Invalid value"),
        (
            {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
            "reasoning_effort",
            "contradicts",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "reasoning_effort": "high"},
            "tool_choice",
            "cannot be combined with thinking",
        ),
        (
            then({"role": "tool", "tool_call_id": "c9", "content": "x"}),
            "messages.1.tool_call_id",
            "matches no",
        ),
        (then({"role": "tool", "content": "x"}), "messages.1.tool_call_id", "required"),
        (ASSISTANT_BAD_ARGS, "messages.0.tool_calls.0.function.arguments", "JSON object"),
        (
            then({"role": "user", "content": "x", "tool_calls": [CALL]}),
            "messages.1.tool_calls",
            "assistant",
        ),
        (user(None), "messages.0.content", "is required"),
        (
            user([{"type": "text", "text": "a"}, IMAGE]),  # a model without image input
            "messages.0.content.1.image_url",
            "image input is not supported by this model",
        ),
        (user([{"type": "input_audio"}]), "messages.0.content.0.type", "audio input"),
        (user([{"type": "fancy"}]), "messages.0.content.0.type", "unknown part type"),
        (user([{"type": "text", "text": 5}]), "messages.0.content.0.text", "string"),
        (user([{"type": "text", "text": "a", "x": 1}]), "messages.0.content.0.x", "not a field"),
    ],
)
def test_bad_tool_and_message_fields_are_400_naming_them(fake, body, param, fragment):
    err = error(fake, **body)
    assert err["param"] == param and fragment in err["message"], err


class PlainTemplate(ByteTokenizer):
    template_knows_tools = False
    template_knows_thinking = False


def test_a_template_that_does_not_know_tools_or_thinking_says_so(fake):
    fake.state.tokenizer = PlainTemplate()
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "none"}):
        err = error(fake, tools=[WEATHER], **choice)
        assert err["param"] == "tools" and "does not render tools" in err["message"]
        assert "named tool_choice or tool_choice 'required'" in err["message"]
    err = error(fake, reasoning_effort="low")
    assert err["param"] == "reasoning_effort" and "no thinking switch" in err["message"]


def test_a_forced_call_on_a_template_without_tools_returns_a_valid_tool_call(fake):
    fake.state.tokenizer = PlainTemplate()
    answer(fake, '{"location": "Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(fake, tools=[WEATHER, TIME], tool_choice=named)["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"location": "Paris"}'}
    submitted = fake.engine.submitted[-1]
    assert json.loads(submitted.params.json_schema) == WEATHER["function"]["parameters"]
    prompt = bytes(submitted.prompt_ids).decode()
    assert not prompt.startswith("tools:")  # the template was given no tools ...
    system, user = prompt.splitlines()[:-1], prompt.splitlines()[-1]
    function = WEATHER["function"]
    assert system[0] == "system: You can call these functions:"  # ... but the model sees them
    assert system[1:3] == [json.dumps(function), json.dumps({"name": "get_time"})]
    assert system[3] == "Call get_weather: answer with its arguments only, as one JSON object."
    assert user == "user: Weather in SF and Tokyo?"


def test_a_required_call_on_a_template_without_tools_joins_the_system_message(fake):
    fake.state.tokenizer = PlainTemplate()
    answer(fake, '[{"name": "get_time", "arguments": {}}]')
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    choice = chat(fake, messages=messages, tools=[WEATHER, TIME], tool_choice="required")
    (call,) = choice["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    prompt = bytes(fake.engine.submitted[-1].prompt_ids).decode()
    assert prompt.startswith("system: You can call these functions:\n")
    assert "answer with a JSON array of calls" in prompt
    assert "\n\nBe brief.\nuser: Weather in SF and Tokyo?\n" in prompt
    assert prompt.count("system: ") == 1
