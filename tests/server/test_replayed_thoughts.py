"""The fourth whole-canvas failure mode from peers' trackers: replayed chain-of-thought in deep
agent loops. An agent sends each assistant message back with its thoughts (`reasoning` or
`reasoning_content`) and tool calls, turn after turn: the prompt must not carry the thoughts
of turns before the last user message (Gemma 4 drops them: re-inserted, they grow every
turn's prompt and the model echoes them), and a response that starts by echoing a thought
channel is still parsed into reasoning, calls and content, streamed or not, with no markup
leaking into any of them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from engine.inputs.tokenizer import Tokenizer
from server.app import ServerState, create_app
from server.parsers import MARKUP
from tests.server.conftest import FakeServer
from tests.server.fake_engine import DEFAULTS, LIMITS, FakeEngine

TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
NUM_TURNS = 6


def call(i: int) -> dict:
    arguments = json.dumps({"q": f"query {i}"})
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "search", "arguments": arguments},
    }


def agent_history(num_turns: int, field: str) -> list[dict]:
    """`num_turns` finished turns (each: a question, a thought with a call, its result, the
    answer), then the current one: a question and a thought with a call and its result."""
    messages: list[dict] = []
    for i in range(num_turns + 1):
        messages.append({"role": "user", "content": f"Question {i}?"})
        thought = {field: f"THOUGHT-{i} plan the search", "content": None}
        messages.append({"role": "assistant", **thought, "tool_calls": [call(i)]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"})
        if i < num_turns:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
    return messages


@pytest.fixture(scope="module")
def gemma(tiny_checkpoint) -> Iterator[FakeServer]:
    """The tiny checkpoint's tokenizer and its Gemma 4 template over a fake engine that answers
    with markup as the model writes it (special tokens)."""
    tokenizer = Tokenizer(tiny_checkpoint("c16"))
    limits = replace(LIMITS, vocab_size=512, max_context_positions=4096, max_fit_positions=4096)
    state = ServerState(
        FakeEngine(limits=limits), tokenizer, replace(DEFAULTS, eos_token_ids=(1,)), "fake"
    )
    server = FakeServer(TestClient(create_app(state)), state.engine, state)  # type: ignore[arg-type]
    with server.client:
        yield server


def answer(server: FakeServer, text: str) -> None:
    tokenizer = server.state.tokenizer
    assert tokenizer is not None
    server.engine.answer = [*tokenizer.encode(text, add_special_tokens=False, markup=True), 1]


def prompt_text(server: FakeServer) -> str:
    tokenizer = server.state.tokenizer
    assert tokenizer is not None
    return tokenizer.markup_decoder(MARKUP)(server.engine.submitted[-1].prompt_ids)


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_the_prompt_carries_no_thought_of_a_turn_before_the_last_user_message(gemma, field):
    answer(gemma, "Done.")
    body = {"messages": agent_history(NUM_TURNS, field), "tools": [TOOL], "max_tokens": 8}
    assert gemma.post("/chat/completions", **body).status_code == 200
    prompt = prompt_text(gemma)
    for i in range(NUM_TURNS):
        assert f"THOUGHT-{i} " not in prompt, i
        assert f"query {i}" in prompt and f"Answer {i}." in prompt  # the rest of each turn stays
    # The current turn's own thought stays with its call, as the model wrote them.
    assert prompt.count("<|channel>thought") == 1 and f"THOUGHT-{NUM_TURNS} " in prompt


def test_the_prompt_does_not_grow_with_the_thoughts_of_earlier_turns(gemma):
    def prompt_length(thought: str) -> int:
        messages = agent_history(NUM_TURNS, "reasoning")
        for m in messages[:-3]:
            if "reasoning" in m:
                m["reasoning"] = thought
        gemma.post("/chat/completions", messages=messages, tools=[TOOL], max_tokens=8)
        return len(gemma.engine.submitted[-1].prompt_ids)

    answer(gemma, "Done.")
    assert prompt_length("short") == prompt_length("a much longer thought " * 20)


ECHOES = {
    "thought-then-call": (
        "<|channel>thought\nTHOUGHT-6 plan the search<channel|>"
        '<|tool_call>call:search{q:<|"|>query 7<|"|>}<tool_call|><|tool_response>',
        "THOUGHT-6 plan the search",
        "",
        [{"q": "query 7"}],
    ),
    "two-thoughts-then-answer": (
        "<|channel>thought\nTHOUGHT-5 plan the search<channel|>"
        "<|channel>thought\nNow answer.<channel|>Answer 6.<turn|>",
        "THOUGHT-5 plan the searchNow answer.",
        "Answer 6.",
        [],
    ),
    "unclosed-thought-into-call": (
        "<|channel>thought\nTHOUGHT-6 again"
        '<|tool_call>call:search{q:<|"|>query 8<|"|>}<tool_call|><|tool_response>',
        "THOUGHT-6 again",
        "",
        [{"q": "query 8"}],
    ),
}


def chat(server: FakeServer, stream: bool, thinking: bool) -> tuple[str, str, list[dict], str]:
    """(reasoning, content, call arguments, finish reason) of a chat, streamed or not."""
    body = {
        "messages": agent_history(2, "reasoning"),
        "tools": [TOOL],
        "max_tokens": 200,
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    if not stream:
        r = server.post("/chat/completions", **body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        message = choice["message"]
        calls = [json.loads(c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return (
            message.get("reasoning") or "",
            message["content"] or "",
            calls,
            choice["finish_reason"],
        )
    reasoning, content, arguments, finish = "", "", {}, ""
    for chunk in server.sse("/chat/completions", **body)[:-1]:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            arguments[piece["index"]] = (
                arguments.get(piece["index"], "") + piece["function"]["arguments"]
            )
        finish = choice["finish_reason"] or finish
    return reasoning, content, [json.loads(arguments[i]) for i in sorted(arguments)], finish


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "not-thinking"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
@pytest.mark.parametrize("echo", list(ECHOES), ids=list(ECHOES))
def test_a_response_that_starts_by_echoing_a_thought_channel_parses(gemma, echo, stream, thinking):
    """With thinking off too: a model that saw thoughts replayed may echo one anyway."""
    text, reasoning, content, calls = ECHOES[echo]
    answer(gemma, text)
    got = chat(gemma, stream, thinking)
    assert got[:3] == (reasoning, content, calls)
    assert got[3] == ("tool_calls" if calls else "stop")
    for marker in MARKUP:
        assert marker not in got[0] + got[1], marker
