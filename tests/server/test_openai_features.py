"""The official `openai` client on the OpenAI features real apps send: content parts, batched
prompts, tools, forced tool choice and thinking, in both decoding modes, streaming and not.

Two servers: the tiny random-weight checkpoint (real engine: shapes, modes, the template), and
the tiny checkpoint's tokenizer over a fake engine that answers with recorded Gemma 4 outputs
tokenised by it (the markup as the special tokens the model writes), so parsing is exercised
end to end through the client."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx
import openai
import pytest
import uvicorn

from engine.inputs.tokenizer import Tokenizer
from server.app import create_app
from server.http import uvicorn_config
from server.state import ServerState
from tests.server.fake_engine import DEFAULTS, LIMITS, FakeEngine
from tests.server.parser_samples import THINK_THEN_CALLS, THOUGHT_AND_ANSWER

MODES = [{"mode": "diffusion"}, {"mode": "ar"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.v1, api_key="unused", max_retries=0)


def stream_text(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
    return texts


@pytest.mark.parametrize("extra", MODES)
def test_content_parts_give_the_answer_of_the_joined_text(client, extra):
    parts = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "something."}]
    common = {"model": "tiny", "max_tokens": 20, "seed": 3, "extra_body": extra}
    joined = client.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me\nsomething."}], **common
    )
    as_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **common
    )
    assert as_parts.choices[0].message.content == joined.choices[0].message.content
    streamed = client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], stream=True, **common
    )
    assert stream_text(streamed) == {0: joined.choices[0].message.content}


@pytest.mark.parametrize("extra", MODES)
def test_a_batch_of_prompts_answers_each_as_alone(client, exact_server, extra):
    """Each prompt of a batch gets its own n choices, in order, with the text it gets alone.
    The texts are compared on the exact server: fast numerics' values depend on the batch
    (a GEMM's last bits depend on its row count, and a canvas's convergence step on those
    bits), so there a batched prompt's text equals its text alone only by luck."""
    common = {
        "model": "tiny",
        "max_tokens": 12,
        "seed": 7,
        "extra_body": {**extra, "ignore_eos": True},
    }
    alone = [client.completions.create(prompt=p, n=2, **common) for p in ("abc", "xyz")]
    batch = client.completions.create(prompt=["abc", "xyz"], n=2, **common)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in batch.choices)
    assert batch.usage.completion_tokens == sum(r.usage.completion_tokens for r in alone) == 48
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    exact = openai.OpenAI(base_url=exact_server.v1, api_key="unused", max_retries=0)
    exact_alone = [exact.completions.create(prompt=p, n=2, **common) for p in ("abc", "xyz")]
    exact_batch = exact.completions.create(prompt=["abc", "xyz"], n=2, **common)
    assert [c.text for c in exact_batch.choices] == [c.text for r in exact_alone for c in r.choices]
    streamed = stream_text(
        client.completions.create(prompt=["abc", "xyz"], n=2, stream=True, **common)
    )
    assert streamed == {c.index: c.text for c in batch.choices}


@pytest.mark.parametrize("extra", MODES)
@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_thinking_reach_the_template_and_answer_in_shape(
    client, live_server, extra, stream
):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[TOOL],
        reasoning_effort="high",
        max_tokens=20,
        seed=1,
        stream=stream,
        extra_body=extra,
    )
    if stream:
        finals = [c.choices[0].finish_reason for c in r if c.choices and c.choices[0].finish_reason]
        assert finals in (["stop"], ["length"], ["tool_calls"])
    else:
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert r.usage.completion_tokens_details.reasoning_tokens >= 0
    body = {
        "messages": messages,
        "tools": [TOOL],
        "chat_template_kwargs": {"enable_thinking": True},
    }
    tokens = httpx.post(f"{live_server.url}/tokenize", json=body).json()["tokens"]
    prompt = httpx.post(f"{live_server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "declaration:get_weather" in prompt
    plain = httpx.post(f"{live_server.url}/tokenize", json={"messages": messages}).json()
    assert plain["count"] < len(tokens) and plain["max_model_len"] > 0


@pytest.mark.parametrize("extra", MODES)
def test_a_named_tool_choice_answers_with_one_call_of_that_function(client, extra):
    named = {"type": "function", "function": {"name": "get_weather"}}
    common = {"model": "tiny", "messages": [{"role": "user", "content": "Paris?"}], "seed": 2}
    r = client.chat.completions.create(
        tools=[TOOL], tool_choice=named, max_tokens=24, extra_body=extra, **common
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    stream = client.chat.completions.create(
        tools=[TOOL], tool_choice=named, max_tokens=24, stream=True, extra_body=extra, **common
    )
    pieces = [p for c in stream if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


@pytest.mark.parametrize("extra", MODES)
def test_exact_numerics_serve_batches_parts_and_tools(exact_server, extra):
    """Exact numerics are batch-invariant: a batched prompt's choice equals it alone."""
    exact = openai.OpenAI(base_url=exact_server.v1, api_key="unused", max_retries=0)
    common = {"model": "tiny", "max_tokens": 10, "seed": 5, "extra_body": extra}
    batch = exact.completions.create(prompt=["abc", "xyz"], **common)
    alone = exact.completions.create(prompt="xyz", **common)
    assert batch.choices[1].text == alone.choices[0].text
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    r = exact.chat.completions.create(
        messages=[{"role": "user", "content": parts}],
        tools=[TOOL],
        reasoning_effort="low",
        **common,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@dataclass
class RecordedServer:
    url: str
    engine: FakeEngine
    tokenizer: Tokenizer

    def model_ids(self, text: str) -> list[int]:
        """What a model writes: its markup spelled in `text` as the special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False, markup=True)

    def answer(self, text: str) -> None:
        eos = 1  # the tiny tokenizer's <eos>
        self.engine.answer = self.model_ids(text) + [eos]


@pytest.fixture(scope="module")
def recorded(tiny_checkpoint) -> Iterator[RecordedServer]:
    tokenizer = Tokenizer(tiny_checkpoint("c16"))
    limits = replace(LIMITS, vocab_size=512, max_context_positions=4096, max_fit_positions=4096)
    engine = FakeEngine(limits=limits)
    state = ServerState(engine, tokenizer, replace(DEFAULTS, eos_token_ids=(1,)), "fake")
    config = uvicorn_config(create_app(state), state.http, host="127.0.0.1", port=0)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not (server.started and server.servers):
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield RecordedServer(f"http://127.0.0.1:{port}", engine, tokenizer)
    server.should_exit = True
    thread.join(timeout=10)


def test_the_recorded_markup_is_special_tokens_that_plain_decoding_hides(recorded):
    ids = recorded.model_ids(THINK_THEN_CALLS)
    assert len(ids) < len(THINK_THEN_CALLS.encode())  # the markers are single tokens
    assert "<|tool_call>" not in recorded.tokenizer.decode(ids)


def test_logprobs_show_the_end_token_as_the_tokenizer_spells_it(recorded):
    recorded.answer("Paris.")
    client = openai.OpenAI(base_url=f"{recorded.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Capital?"}], logprobs=True
    )
    *text, end = [e.token for e in r.choices[0].logprobs.content]
    assert end == "<eos>" == recorded.tokenizer.special_token_texts[1]
    assert "".join(text) == r.choices[0].message.content == "Paris."


@pytest.mark.parametrize("stream", [False, True])
def test_recorded_tool_calls_and_thoughts_through_the_client(recorded, stream):
    recorded.answer(THINK_THEN_CALLS)
    client = openai.OpenAI(base_url=f"{recorded.url}/v1", api_key="unused", max_retries=0)
    common = {"model": "fake", "messages": [{"role": "user", "content": "SF and Tokyo?"}]}
    r = client.chat.completions.create(tools=[TOOL], max_tokens=400, stream=stream, **common)
    if not stream:
        choice = r.choices[0]
        reasoning = choice.message.model_extra["reasoning_content"]
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        finish, content = choice.finish_reason, choice.message.content
        assert r.usage.completion_tokens_details.reasoning_tokens > 0
    else:
        chunks = [c.choices[0] for c in r if c.choices]
        reasoning = "".join(c.delta.model_extra.get("reasoning_content", "") for c in chunks)
        pieces = [p for c in chunks for p in c.delta.tool_calls or []]
        calls = [(p.function.name, json.loads(p.function.arguments)) for p in pieces]
        finish = next(c.finish_reason for c in chunks if c.finish_reason)
        content = "".join(c.delta.content or "" for c in chunks) or None
    assert reasoning == "The user wants the weather in two cities; call the tool twice."
    assert calls == [
        ("get_weather", {"location": "San Francisco, CA", "unit": "celsius"}),
        ("get_weather", {"location": "Tokyo", "unit": "celsius"}),
    ]
    assert finish == "tool_calls" and content is None


def test_recorded_thoughts_apart_from_the_answer_through_the_client(recorded):
    recorded.answer(THOUGHT_AND_ANSWER)
    client = openai.OpenAI(base_url=f"{recorded.url}/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "2+2?"}], max_tokens=400
    )
    message = r.choices[0].message
    assert message.content == "2 + 2 = 4." and message.model_extra["reasoning_content"] == (
        "Simple arithmetic."
    )
    thought = recorded.model_ids("<|channel>thought\nSimple arithmetic.<channel|>")
    assert r.usage.completion_tokens_details.reasoning_tokens == len(thought)


def test_a_template_that_raises_refuses_the_conversation_with_a_value_error(tmp_path):
    from engine.checkpoints.tiny import build_tokenizer

    tok = build_tokenizer(512)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="roles must alternate"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_the_tiny_template_renders_a_tool_conversation_in_gemma4_format():
    from engine.checkpoints.tiny import build_tokenizer

    tok = build_tokenizer(512)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather"}}
    call["function"]["arguments"] = {"location": "SF", "days": 2, "hourly": True}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "Ask."},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tok.apply_chat_template(
        messages, tools=[TOOL], enable_thinking=True, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<bos><|turn>system\n<|think|>\nBe brief."
        '<|tool>declaration:get_weather{description:<|"|>The weather in a city<|"|>,'
        'parameters:{properties:{location:{type:<|"|>string<|"|>}},required:[<|"|>location<|"|>],'
        'type:<|"|>object<|"|>}}<tool|><turn|>\n'
        "<|turn>user\nWeather?<turn|>\n"
        "<|turn>model\n<|channel>thought\nAsk.<channel|>"
        '<|tool_call>call:get_weather{days:2,hourly:true,location:<|"|>SF<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
        "Sunny.<turn|>\n<|turn>user\nThanks<turn|>\n<|turn>model\n"
    )
    pending = tok.apply_chat_template(messages[:4], add_generation_prompt=True, tokenize=False)
    assert pending.endswith("<tool_response|>")  # the model goes on in its own turn
