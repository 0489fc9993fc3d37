"""What vLLM's clients send back and read: the openai SDK's `message.model_dump()` appended to
the history (the agent loop), an assistant's thoughts under `reasoning` or `reasoning_content`,
and the field(s) `--reasoning-field` sends them under, streamed and not.

The server is the tiny checkpoint's tokenizer (its Gemma 4-format template renders a tool
turn's thought) over a fake engine that answers with recorded Gemma 4 outputs; the official
client talks to it through Starlette's TestClient."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage

from engine.inputs.tokenizer import Tokenizer
from server.app import create_app
from server.state import ServerState
from tests.server.fake_engine import DEFAULTS, LIMITS, FakeEngine
from tests.server.parser_samples import THINK_THEN_CALLS, THOUGHT_AND_ANSWER

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
    },
}
ASK = {"role": "user", "content": "Weather in SF and Tokyo?"}
FIRST_THOUGHT = "The user wants the weather in two cities; call the tool twice."
CALL = {"id": "call_1", "type": "function"}
CALL["function"] = {"name": "get_weather", "arguments": '{"location": "SF"}'}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@dataclass
class Served:
    client: TestClient
    engine: FakeEngine
    tokenizer: Tokenizer

    def answer(self, text: str) -> None:
        ids = self.tokenizer.encode(text, add_special_tokens=False, markup=True)
        self.engine.answer = [*ids, 1]  # the tiny tokenizer's <eos>

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key="-", max_retries=0, http_client=self.client
        )

    def chat(self, messages: list[dict[str, Any]], **body: Any) -> Any:
        r = self.client.post(
            "/v1/chat/completions",
            json={"model": "fake", "messages": messages, "max_tokens": 400, **body},
        )
        return r.status_code, r.json()

    def last_prompt(self) -> str:
        """The last request's prompt as the template wrote it, markup included."""
        return str(self.tokenizer.hf.decode(self.engine.submitted[-1].prompt_ids))


@pytest.fixture
def served(tiny_checkpoint, request) -> Iterator[Served]:
    """The server with `--reasoning-field` set to the test's parameter (default: both)."""
    tokenizer = Tokenizer(tiny_checkpoint("c16"))
    limits = replace(LIMITS, vocab_size=512, max_context_positions=4096, max_fit_positions=4096)
    engine = FakeEngine(limits=limits)
    defaults = replace(DEFAULTS, eos_token_ids=(1,))
    field = getattr(request, "param", "both")
    state = ServerState(engine, tokenizer, defaults, "fake", reasoning_field=field)
    with TestClient(create_app(state)) as client:
        yield Served(client, engine, tokenizer)


def test_the_sdk_model_dump_of_an_answer_goes_back_into_the_history(served):
    served.answer(THINK_THEN_CALLS)
    sdk = served.sdk()
    first = sdk.chat.completions.create(
        model="fake", messages=[ASK], tools=[TOOL], max_tokens=400
    ).choices[0]
    dumped = first.message.model_dump()
    # What the agent loop appends: the SDK's null fields, the calls and the thought.
    assert {k: dumped[k] for k in ("refusal", "annotations", "audio", "function_call")} == {
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    assert dumped["reasoning"] == dumped["reasoning_content"] == FIRST_THOUGHT
    replies = [
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
        for call in first.message.tool_calls
    ]
    served.answer(THOUGHT_AND_ANSWER)
    second = sdk.chat.completions.create(
        model="fake", messages=[ASK, dumped, *replies], tools=[TOOL], max_tokens=400
    )
    assert second.choices[0].message.content == "2 + 2 = 4."
    prompt = served.last_prompt()
    assert f"<|channel>thought\n{FIRST_THOUGHT}<channel|><|tool_call>call:get_weather" in prompt
    assert prompt.count("<|tool_response>response:get_weather") == 2


def test_a_plain_sdk_answer_with_empty_annotations_is_served(served):
    message = ChatCompletionMessage(role="assistant", content="Hi.", annotations=[])
    status, body = served.chat([ASK, message.model_dump(), {"role": "user", "content": "And?"}])
    assert status == 200, body
    assert "model\nHi.<turn|>" in served.last_prompt()


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("audio", {"id": "audio_1"}, "audio output is not supported"),
        ("function_call", {"name": "get_weather", "arguments": "{}"}, "send tool_calls"),
        ("refusal", "I can't help with that.", "a refusal cannot be shown"),
        ("annotations", [{"type": "url_citation"}], "cannot be shown to the model"),
    ],
)
def test_a_value_canvas_cannot_honour_is_refused_by_name(served, field, value, why):
    message = ChatCompletionMessage(role="assistant", content="Hi.").model_dump()
    status, body = served.chat([ASK, {**message, field: value}, ASK])
    assert status == 400, body
    assert body["error"]["param"] == f"messages.1.{field}" and why in body["error"]["message"]


def test_reasoning_reaches_the_template_exactly_as_reasoning_content(served):
    prompts = []
    for name in ("reasoning", "reasoning_content"):
        said = {"role": "assistant", "content": None, "tool_calls": [CALL], name: "Ask."}
        status, body = served.chat([ASK, said, ANSWERED])
        assert status == 200, body
        prompts.append(served.engine.submitted[-1].prompt_ids)
    assert prompts[0] == prompts[1]
    assert "<|channel>thought\nAsk.<channel|><|tool_call>" in served.last_prompt()


def test_reasoning_under_both_names_must_agree(served):
    said = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    status, body = served.chat(
        [ASK, {**said, "reasoning": "A", "reasoning_content": "A"}, ANSWERED]
    )
    assert status == 200, body
    status, body = served.chat(
        [ASK, {**said, "reasoning": "A", "reasoning_content": "B"}, ANSWERED]
    )
    assert status == 400 and body["error"]["param"] == "messages.1.reasoning"
    status, body = served.chat([{**ASK, "reasoning": "A"}])
    assert status == 400 and body["error"]["param"] == "messages.0.reasoning"


SENT = {
    "both": {"reasoning", "reasoning_content"},
    "reasoning": {"reasoning"},
    "reasoning_content": {"reasoning_content"},
}


@pytest.mark.parametrize("served", list(SENT), indirect=True)
def test_responses_carry_the_thought_under_the_fields_the_flag_picks(served, request):
    expected = SENT[request.node.callspec.params["served"]]
    served.answer(THOUGHT_AND_ANSWER)
    status, body = served.chat([ASK])
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert {k for k in message if k.startswith("reasoning")} == expected
    assert {message[k] for k in expected} == {"Simple arithmetic."}
    r = served.client.post(
        "/v1/chat/completions",
        json={"model": "fake", "messages": [ASK], "max_tokens": 400, "stream": True},
    )
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [delta for line in lines for delta in sdk_deltas(line)]
    for name in ("reasoning", "reasoning_content"):
        streamed = "".join(d.get(name) or "" for d in deltas)
        assert streamed == ("Simple arithmetic." if name in expected else "")


def sdk_deltas(line: str) -> list[dict[str, Any]]:
    """The deltas of a chunk as the SDK reads them."""
    chunk = ChatCompletionChunk.model_validate_json(line)
    return [choice.delta.model_dump() for choice in chunk.choices]


def test_the_reasoning_field_flag_takes_only_its_choices():
    from server.cli.serve import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).reasoning_field == "both"
    assert parser.parse_args(["--reasoning-field", "reasoning"]).reasoning_field == "reasoning"
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-field", "thoughts"])


def test_canvas_serve_keeps_the_reasoning_field_it_is_given(tiny_checkpoint):
    from tests.server.conftest import start_server

    server, stop = start_server(str(tiny_checkpoint("c16")), "--reasoning-field", "reasoning")
    try:
        assert server.state.reasoning_field == "reasoning"
    finally:
        stop()
