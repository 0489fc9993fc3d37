"""/v1/responses with the official `openai` client: text, thoughts as reasoning items, function
tools over an agent loop (the output items sent back with function_call_output items), JSON
formats, limits and sampling reaching the engine, the stream's events (and that the SDK's own
stream accumulator rebuilds the same response), stateless `store`, every refusal naming the
Responses field the client sent, and one plain and one streamed response from the real engine
on the tiny checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.parser_samples import THINK_THEN_CALLS, THOUGHT_AND_ANSWER
from tests.server.sdk_cases import SdkServer, sdk_server

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string"}, "unit": {"type": "string"}},
    },
    "strict": False,
}
ASK = "Weather in SF and Tokyo?"
THOUGHT = "The user wants the weather in two cities; call the tool twice."


@pytest.fixture
def served(tiny_checkpoint) -> Iterator[SdkServer]:
    with sdk_server(tiny_checkpoint("c16")) as server:
        yield server


def without_ids(items: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.model_dump().items() if k != "id"} for item in items]


def test_text_with_instructions_is_one_message_item(served):
    served.answer("Hello there.")
    response = served.sdk().responses.create(
        model="fake", input="Hi", instructions="Be brief.", max_output_tokens=50
    )
    assert response.object == "response" and response.status == "completed"
    assert response.output_text == "Hello there."
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.instructions == "Be brief." and response.max_output_tokens == 50
    assert response.model_dump()["store"] is False
    usage = response.usage
    assert usage.input_tokens == len(served.engine.submitted[-1].prompt_ids)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    prompt = served.last_prompt()
    assert prompt.index("Be brief.") < prompt.index("Hi")  # the instructions lead, as system
    assert served.engine.submitted[-1].params.max_tokens == 50


def test_thoughts_are_a_reasoning_item_before_the_answer(served):
    served.answer(THOUGHT_AND_ANSWER)
    response = served.sdk().responses.create(model="fake", input="2 + 2?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [
        ("reasoning_text", "Simple arithmetic.")
    ]
    assert message.type == "message" and response.output_text == "2 + 2 = 4."
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_the_agent_loop_sends_the_output_back_with_function_call_outputs(served):
    sdk = served.sdk()
    served.answer(THINK_THEN_CALLS)
    first = sdk.responses.create(
        model="fake", input=[{"role": "user", "content": ASK}], tools=[TOOL]
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert [item.type for item in first.output] == ["reasoning", "function_call", "function_call"]
    assert [json.loads(c.arguments)["location"] for c in calls] == ["San Francisco, CA", "Tokyo"]
    assert {c.name for c in calls} == {"get_weather"} and len({c.call_id for c in calls}) == 2
    assert first.status == "completed" and first.output_text == ""
    history: list[Any] = [{"role": "user", "content": ASK}, *first.output]
    history += [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"sky": "sunny"}'}
        for c in calls
    ]
    served.answer(THOUGHT_AND_ANSWER)
    second = sdk.responses.create(model="fake", input=history, tools=[TOOL])
    assert second.output_text == "2 + 2 = 4."
    prompt = served.last_prompt()
    # One assistant turn: the thought, then both calls; then both answers.
    assert f"<|channel>thought\n{THOUGHT}<channel|><|tool_call>call:get_weather" in prompt
    assert prompt.count("<|tool_call>call:get_weather") == 2
    assert prompt.count("<|tool_response>response:get_weather") == 2


def test_a_message_before_a_call_is_one_assistant_turn(served):
    status, body = served.post(
        "/responses",
        input=[
            {"role": "user", "content": ASK},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=[TOOL],
    )
    assert status == 200, body
    assert "Checking.<|tool_call>call:get_weather{}" in served.last_prompt()


@pytest.mark.parametrize(
    ("fmt", "schema"),
    [
        ({"type": "json_object"}, {"type": "object"}),
        (
            {
                "type": "json_schema",
                "name": "city",
                "schema": {"type": "object", "required": ["a"]},
            },
            {"type": "object", "required": ["a"]},
        ),
    ],
)
def test_text_format_constrains_the_output(served, fmt, schema):
    served.answer('{"a": 1}')
    response = served.sdk().responses.create(model="fake", input="JSON?", text={"format": fmt})
    assert json.loads(served.engine.submitted[-1].params.json_schema) == schema
    assert response.text.format.type == fmt["type"]


def test_a_forced_function_call_is_one_function_call_item(served):
    served.answer('{"location": "Paris"}')
    response = served.sdk().responses.create(
        model="fake",
        input="Weather in Paris?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = response.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call",
        "get_weather",
        {"location": "Paris"},
    )
    schema = json.loads(served.engine.submitted[-1].params.json_schema)
    assert schema["properties"]["location"] == {"type": "string"}


def test_sampling_and_extras_reach_the_engine_as_on_chat(served):
    sampling = {"temperature": 0.5, "top_p": 0.9}
    extras = {"seed": 7, "top_k": 20, "max_denoising_steps": 12, "mode": "ar"}
    served.sdk().responses.create(model="fake", input="Hi", **sampling, extra_body=extras)
    params = served.engine.submitted[-1].params
    assert (params.temperature, params.top_p, params.seed, params.top_k) == (0.5, 0.9, 7, 20)
    assert params.max_denoising_steps == 12
    status, body = served.post(
        "/chat/completions", messages=[{"role": "user", "content": "Hi"}], **sampling, **extras
    )
    assert status == 200, body
    assert served.engine.submitted[-1].params == params


def test_the_token_limit_makes_an_incomplete_response(served):
    served.answer("A long answer that does not fit.")
    response = served.sdk().responses.create(model="fake", input="Hi", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens == 3


@pytest.mark.parametrize("store", [True, False, None])
def test_store_is_accepted_and_nothing_is_stored(served, store):
    extra = {} if store is None else {"store": store}
    status, body = served.post("/responses", input="Hi", **extra)
    assert status == 200, body
    assert body["store"] is False and body["previous_response_id"] is None


def stream_events(served: SdkServer, **body: Any) -> list[Any]:
    with served.sdk().responses.create(model="fake", stream=True, **body) as stream:
        return list(stream)


def test_the_stream_events_build_the_plain_response(served):
    served.answer(THOUGHT_AND_ANSWER)
    plain = served.sdk().responses.create(model="fake", input="2 + 2?")
    events = stream_events(served, input="2 + 2?")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    expected = [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [k for i, k in enumerate(kinds[2:-1]) if k != kinds[2:-1][i - 1] or i == 0] == expected
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "2 + 2 = 4."
    done = events[-1].response
    assert without_ids(done.output) == without_ids(plain.output)
    assert done.usage == plain.usage
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in done.output]


def test_the_sdk_stream_helper_accumulates_the_same_response(served):
    served.answer(THOUGHT_AND_ANSWER)
    with served.sdk().responses.stream(model="fake", input="2 + 2?") as stream:
        final = stream.get_final_response()
    assert final.output_text == "2 + 2 = 4."
    assert final.output[0].content[0].text == "Simple arithmetic."


def test_streamed_calls_send_their_arguments(served):
    served.answer(THINK_THEN_CALLS)
    events = stream_events(served, input=ASK, tools=[TOOL])
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments)["location"] for e in done] == ["San Francisco, CA", "Tokyo"]
    for e in done:
        kind = "response.function_call_arguments.delta"
        pieces = [d.delta for d in events if d.type == kind and d.item_id == e.item_id]
        assert "".join(pieces) == e.arguments
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call", "function_call"]
    assert all(i.status == "completed" for i in final.output)


def test_a_stream_cut_at_the_limit_ends_incomplete(served):
    served.answer("A long answer that does not fit.")
    events = stream_events(served, input="Hi", max_output_tokens=3)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_failure_mid_stream_is_an_error_event_then_failed(served):
    served.answer("A long answer.")
    served.engine.fail_after = 2
    events = stream_events(served, input="Hi")
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and events[-1].response.error is not None


REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"background": True}, "background", "stored"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "no extra output"),
    ({"truncation": "auto"}, "truncation", "only 'disabled'"),
    ({"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key", "not a parameter"),
    ({"n": 2}, "n", "not a parameter"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "no reasoning summaries"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", ""),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "required"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "functions only"),
    ({"tools": [{**TOOL, "name": "no spaces"}]}, "tools.0.name", "letters, digits"),
    ({"tools": [{**TOOL, "color": 1}]}, "tools.0.color", ""),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice.type", "not supported"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.name", ""),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "stores nothing"),
    ({"input": [{"type": "web_search_call"}]}, "input.0.type", "not supported"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
        "input.0.content.0.type",
        "file",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
        "input.0.content.0.text",
        "string",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
        "input.0.content.0.image_url",
        "image input is not supported",
    ),
    (
        {
            "input": [
                {"role": "user", "content": "Hi"},
                {"type": "function_call_output", "call_id": "x", "output": "1"},
            ]
        },
        "input.1.call_id",
        "matches no tool call",
    ),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "followed by the assistant"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input.0.role", "must be one of"),
]


@pytest.mark.parametrize(("fields", "param", "why"), REFUSED, ids=[r[1] for r in REFUSED])
def test_what_canvas_cannot_serve_is_refused_by_name(served, fields, param, why):
    status, body = served.post("/responses", **{"input": "Hi", **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and why in body["error"]["message"]


def test_an_error_in_the_instructions_names_them(served):
    body = '{"model": "fake", "input": "Hi", "instructions": "\\ud800"}'
    r = served.client.post(
        "/v1/responses", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "instructions" and "lone surrogate" in error["message"]


def test_the_sdk_raises_the_refusal(served):
    import openai

    with pytest.raises(openai.BadRequestError) as raised:
        served.sdk().responses.create(model="fake", input="Hi", previous_response_id="resp_1")
    assert raised.value.param == "previous_response_id"


def test_an_input_image_is_served_as_chat_serves_an_image_url_part(vision_checkpoint):
    from engine.inputs.images import ImageLimits, ImageProcessor
    from server.media import Media, MediaPolicy
    from tests.media import data_url, encode, noise_image

    url = data_url(encode(noise_image(40, 60)))
    media = Media(ImageProcessor(vision_checkpoint, ImageLimits()), MediaPolicy())
    with sdk_server(vision_checkpoint, media=media) as server:
        server.sdk().responses.create(
            model="fake",
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": url, "detail": "low"},
                    ],
                }
            ],
        )
        seen = server.engine.submitted[-1]
        parts = [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        ]
        status, body = server.post(
            "/chat/completions", messages=[{"role": "user", "content": parts}]
        )
        assert status == 200, body
    assert len(seen.images) == 1
    assert seen.prompt_ids == server.engine.submitted[-1].prompt_ids
    assert len(seen.prompt_ids) > len(server.tokenizer.encode("What is this?")) + 16


def test_each_stream_frame_names_its_event_and_no_done_line_follows(served):
    served.answer(THOUGHT_AND_ANSWER)
    r = served.client.post("/v1/responses", json={"model": "fake", "input": "Hi", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [frame for frame in r.text.split("\n\n") if frame]
    for frame in frames:
        event, data = frame.split("\n")
        assert event.removeprefix("event: ") == json.loads(data.removeprefix("data: "))["type"]
    assert "[DONE]" not in r.text


def test_a_reasoning_item_with_only_a_summary_gives_its_text(served):
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Ask."}]}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    status, body = served.post(
        "/responses",
        input=[
            {"role": "user", "content": ASK},
            thought,
            call,
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "sunny"}],
            },
        ],
        tools=[TOOL],
    )
    assert status == 200, body
    prompt = served.last_prompt()
    assert "<|channel>thought\nAsk.<channel|><|tool_call>call:get_weather{}" in prompt
    assert "sunny" in prompt


def test_the_real_engine_serves_a_response_and_its_stream(live_server):
    import httpx
    import openai

    with httpx.Client(timeout=60) as http:
        sdk = openai.OpenAI(base_url=live_server.v1, api_key="-", http_client=http)
        plain = sdk.responses.create(
            model="tiny", input="Hello", max_output_tokens=6, extra_body={"seed": 3}
        )
        with sdk.responses.create(
            model="tiny", input="Hello", max_output_tokens=6, extra_body={"seed": 3}, stream=True
        ) as stream:
            events = list(stream)
    assert plain.status in ("completed", "incomplete") and plain.usage.output_tokens <= 6
    done = events[-1].response
    assert events[-1].type == f"response.{plain.status}"
    assert done.output_text == plain.output_text and done.usage == plain.usage


def test_an_empty_answer_is_one_empty_message_streamed_or_not(served):
    served.answer("")
    plain = served.sdk().responses.create(model="fake", input="Hi")
    assert [(i.type, i.content[0].text) for i in plain.output] == [("message", "")]
    events = stream_events(served, input="Hi")
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert without_ids(events[-1].response.output) == without_ids(plain.output)
