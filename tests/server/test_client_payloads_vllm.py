"""The client check: what vLLM users' clients send, each served as vLLM serves it (200 with the
shape the client reads) or refused by name (a 400 naming the field) where Canvas cannot honour
it. Bodies as the clients build them: issue 43's fields, the `openai` SDK, LangChain's
ChatOpenAI (invoke, stream with usage, bind_tools round trip, with_structured_output) and
LiteLLM's OpenAI-compatible provider; then the SDK's own flows (the chat agent loop with
`message.model_dump()`, `client.responses.create` plain, streamed and in an agent loop)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.server.parser_samples import THINK_THEN_CALLS, THOUGHT_AND_ANSWER
from tests.server.sdk_cases import ASK, TOOL, SdkServer, sdk_server

CHAT, COMPLETIONS, RESPONSES = "/chat/completions", "/completions", "/responses"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CALL = {"id": "call_1", "type": "function"}
CALL["function"] = {"name": "get_weather", "arguments": '{"location": "SF"}'}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
ANSWERED = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PNG_URL = "data:image/png;base64,iVBORw0KGgo="


@dataclass(frozen=True)
class Payload:
    """A request body a client sends; served (200, then `check` on the body or the stream's
    parsed data) unless `refused` names the parameter its 400 must name."""

    name: str
    path: str
    body: dict[str, Any]
    refused: str | None = None
    answer: str = "Hello."
    check: Callable[[SdkServer, Any], None] | None = None


def chat(*messages: dict[str, Any], **body: Any) -> dict[str, Any]:
    return {"messages": list(messages) or [ASK], **body}


def params(server: SdkServer) -> Any:
    return server.engine.submitted[-1].params


def has_calls(server: SdkServer, body: Any) -> None:
    choice = body["choices"][0]
    assert choice["message"]["tool_calls"] and choice["finish_reason"] == "tool_calls"


def has_the_named_call(server: SdkServer, body: Any) -> None:
    """A named tool choice finishes "stop", as on OpenAI and vLLM."""
    choice = body["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "stop"


def has_schema(server: SdkServer, body: Any) -> None:
    assert json.loads(params(server).json_schema) is not None


def ends_with_usage(server: SdkServer, chunks: list[Any]) -> None:
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def seed_11_reaches_the_engine(server: SdkServer, body: Any) -> None:
    assert params(server).seed == 11


def two_choices(server: SdkServer, body: Any) -> None:
    assert [c["index"] for c in body["choices"]] == [0, 1]


def top_logprobs(server: SdkServer, body: Any) -> None:
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


def usage_in_every_chunk(server: SdkServer, chunks: list[Any]) -> None:
    assert all(chunk["usage"] is not None for chunk in chunks)


PAYLOADS = [
    # issue 43's fields
    Payload("history_reasoning", CHAT, chat(ASK, {**CALLED, "reasoning": "Ask."}, ANSWERED)),
    Payload(
        "history_reasoning_content",
        CHAT,
        chat(ASK, {**CALLED, "reasoning_content": "Ask."}, ANSWERED),
    ),
    Payload("min_p", CHAT, chat(min_p=0.1)),
    Payload("logit_bias", CHAT, chat(logit_bias={"50": -100})),
    Payload("presence_penalty", CHAT, chat(presence_penalty=0.5)),
    Payload("frequency_penalty", CHAT, chat(frequency_penalty=0.5)),
    Payload("repetition_penalty", CHAT, chat(repetition_penalty=1.2)),
    Payload("stop_token_ids", CHAT, chat(stop_token_ids=[50])),
    Payload(
        "include_stop_str_in_output",
        CHAT,
        chat(stop=["l"], include_stop_str_in_output=True),
    ),
    Payload("skip_special_tokens", CHAT, chat(skip_special_tokens=False)),
    Payload(
        "continuous_usage_stats",
        CHAT,
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        check=usage_in_every_chunk,
    ),
    Payload("ignore_eos", CHAT, chat(ignore_eos=True, max_tokens=5)),
    Payload("no_max_tokens", CHAT, chat()),
    # the openai SDK's fields
    Payload("max_completion_tokens", CHAT, chat(max_completion_tokens=20)),
    Payload("developer_role", CHAT, chat({"role": "developer", "content": "Be brief."}, ASK)),
    Payload(
        "text_parts",
        CHAT,
        chat({"role": "user", "content": [{"type": "text", "text": "Hi"}]}),
    ),
    Payload(
        "seed",
        CHAT,
        chat(seed=11),
        check=seed_11_reaches_the_engine,
    ),
    Payload("top_k", CHAT, chat(top_k=20)),
    Payload(
        "n_2",
        CHAT,
        chat(n=2),
        check=two_choices,
    ),
    Payload(
        "logprobs",
        CHAT,
        chat(logprobs=True, top_logprobs=2),
        check=top_logprobs,
    ),
    Payload(
        "json_schema",
        CHAT,
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        ),
        answer='{"a": 1}',
        check=has_schema,
    ),
    Payload(
        "json_object",
        CHAT,
        chat(response_format={"type": "json_object"}),
        answer='{"a": 1}',
        check=has_schema,
    ),
    Payload("tools_auto", CHAT, chat(tools=[TOOL]), answer=THINK_THEN_CALLS, check=has_calls),
    Payload(
        "tool_choice_named",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        answer='{"location": "SF"}',
        check=has_the_named_call,
    ),
    Payload(
        "tool_choice_required",
        CHAT,
        chat(tools=[TOOL], tool_choice="required"),
        answer='[{"name": "get_weather", "arguments": {"location": "SF"}}]',
        check=has_calls,
    ),
    Payload("reasoning_effort", CHAT, chat(reasoning_effort="low"), answer=THOUGHT_AND_ANSWER),
    Payload(
        "enable_thinking",
        CHAT,
        chat(chat_template_kwargs={"enable_thinking": True}),
        answer=THOUGHT_AND_ANSWER,
    ),
    Payload(
        "stream_usage",
        CHAT,
        chat(stream=True, stream_options={"include_usage": True}),
        check=ends_with_usage,
    ),
    Payload(
        "image_on_a_text_model",
        CHAT,
        chat(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": PNG_URL}},
                ],
            }
        ),
        refused="messages.0.content.1.image_url",
    ),
    Payload("legacy_functions", CHAT, chat(functions=[TOOL["function"]]), refused="functions"),
    Payload("completions_token_ids", COMPLETIONS, {"prompt": [72, 105], "max_tokens": 5}),
    Payload("completions_logprobs", COMPLETIONS, {"prompt": "Hi", "logprobs": 2}),
    Payload("completions_echo", COMPLETIONS, {"prompt": "Hi", "echo": True}, refused="echo"),
    Payload("completions_best_of", COMPLETIONS, {"prompt": "Hi", "best_of": 2}, refused="best_of"),
    # LangChain's ChatOpenAI
    Payload(
        "langchain_invoke",
        CHAT,
        chat(SYSTEM, {"role": "user", "content": "Hi", "name": "alice"}, stream=False, n=1),
    ),
    Payload(
        "langchain_stream",
        CHAT,
        chat(stream=True, n=1, temperature=0.0, stream_options={"include_usage": True}),
        check=ends_with_usage,
    ),
    Payload(
        "langchain_tool_round_trip",
        CHAT,
        chat(
            ASK,
            CALLED,
            {"content": "sunny", "role": "tool", "tool_call_id": "call_1"},
            stream=False,
            tools=[TOOL],
            parallel_tool_calls=False,
        ),
    ),
    Payload(
        "langchain_structured_output",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "A",
                    "description": "An a.",
                    "strict": True,
                    "schema": SCHEMA,
                },
            },
            stream=False,
        ),
        answer='{"a": 1}',
        check=has_schema,
    ),
    # LiteLLM's OpenAI-compatible (hosted_vllm) provider
    Payload(
        "litellm_stream",
        CHAT,
        chat(
            temperature=0.2,
            top_p=0.9,
            max_tokens=30,
            stop=["\n\n"],
            seed=1,
            user="litellm-user",
            stream=True,
            stream_options={"include_usage": True},
        ),
        check=ends_with_usage,
    ),
    Payload("litellm_metadata", CHAT, chat(user="u1", metadata={"trace_id": "t1"})),
    # /v1/responses bodies
    Payload("responses_text", RESPONSES, {"input": "Hi", "instructions": "Be brief."}),
    Payload("responses_store_false", RESPONSES, {"input": "Hi", "store": False}),
    Payload(
        "responses_previous_response_id",
        RESPONSES,
        {"input": "Hi", "previous_response_id": "resp_1"},
        refused="previous_response_id",
    ),
]


@pytest.fixture(scope="module")
def served(tiny_checkpoint) -> Iterator[SdkServer]:
    with sdk_server(tiny_checkpoint("c16")) as server:
        yield server


def stream_data(text: str) -> list[Any]:
    """A stream's data lines, parsed, up to [DONE] (which must end it)."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


OBJECTS = {CHAT: "chat.completion", COMPLETIONS: "text_completion", RESPONSES: "response"}


@pytest.mark.parametrize("payload", PAYLOADS, ids=[p.name for p in PAYLOADS])
def test_a_client_payload_is_served_as_vllm_serves_it_or_refused_by_name(served, payload):
    served.answer(payload.answer)
    r = served.client.post(f"/v1{payload.path}", json={"model": "fake", **payload.body})
    if payload.refused is not None:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == payload.refused
        return
    assert r.status_code == 200, r.text
    if payload.body.get("stream"):
        chunks = stream_data(r.text)
        assert {c["object"] for c in chunks} == {f"{OBJECTS[payload.path]}.chunk"}
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        data: Any = chunks
    else:
        data = r.json()
        assert data["object"] == OBJECTS[payload.path]
        if payload.path == RESPONSES:
            assert data["status"] == "completed" and data["store"] is False
        else:
            assert data["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
            assert data["usage"]["total_tokens"] > 0
    if payload.check is not None:
        payload.check(served, data)


def sdk_agent_loop(served: SdkServer) -> None:
    sdk = served.sdk()
    served.answer(THINK_THEN_CALLS)
    first = sdk.chat.completions.create(model="fake", messages=[ASK], tools=[TOOL])
    message = first.choices[0].message
    replies = [
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
        for call in message.tool_calls or []
    ]
    assert len(replies) == 2
    served.answer(THOUGHT_AND_ANSWER)
    history = [ASK, message.model_dump(), *replies]
    second = sdk.chat.completions.create(model="fake", messages=history, tools=[TOOL])
    assert second.choices[0].message.content == "2 + 2 = 4."


def sdk_stream_chat(served: SdkServer) -> None:
    served.answer(THOUGHT_AND_ANSWER)
    stream = served.sdk().chat.completions.create(
        model="fake", messages=[ASK], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "2 + 2 = 4." and chunks[-1].usage is not None


def sdk_responses_plain(served: SdkServer) -> None:
    served.answer(THOUGHT_AND_ANSWER)
    response = served.sdk().responses.create(model="fake", input="2 + 2?", store=False)
    assert response.output_text == "2 + 2 = 4." and response.output[0].type == "reasoning"


def sdk_responses_stream(served: SdkServer) -> None:
    served.answer(THOUGHT_AND_ANSWER)
    with served.sdk().responses.create(model="fake", input="2 + 2?", stream=True) as stream:
        events = list(stream)
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "2 + 2 = 4."


def sdk_responses_agent_loop(served: SdkServer) -> None:
    sdk = served.sdk()
    tool = {"type": "function", **TOOL["function"]}
    served.answer(THINK_THEN_CALLS)
    first = sdk.responses.create(model="fake", input=ASK["content"], tools=[tool])
    calls = [item for item in first.output if item.type == "function_call"]
    outputs = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls
    ]
    served.answer(THOUGHT_AND_ANSWER)
    history = [{"role": "user", "content": ASK["content"]}, *first.output, *outputs]
    second = sdk.responses.create(model="fake", input=history, tools=[tool])
    assert len(calls) == 2 and second.output_text == "2 + 2 = 4."


FLOWS = [sdk_agent_loop, sdk_stream_chat, sdk_responses_plain, sdk_responses_stream]
FLOWS.append(sdk_responses_agent_loop)


@pytest.mark.parametrize("flow", FLOWS, ids=[f.__name__ for f in FLOWS])
def test_an_sdk_flow_is_served_as_vllm_serves_it(served, flow):
    flow(served)
