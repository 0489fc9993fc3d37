"""Batched /v1/completions prompts, and /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

import pytest

from tests.server.conftest import make_fake_server
from tests.server.fake_engine import LIMITS, letters


def test_a_batch_of_prompts_gets_n_choices_each_indexed_by_prompt(fake):
    r = fake.post("/completions", prompt=["ab", "cde"], n=2, max_tokens=4, seed=1)
    body = r.json()
    assert r.status_code == 200, r.text
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    submitted = {s.request_id.rsplit("-", 1)[1]: s for s in fake.engine.submitted}
    assert [submitted[str(i)].prompt_ids for i in range(4)] == [
        list(b"ab"),
        list(b"ab"),
        list(b"cde"),
        list(b"cde"),
    ]
    # Choice i of each prompt samples with seed + i, as a single prompt's choices do.
    assert [c["text"] for c in body["choices"]] == ["bcde", "cdef", "bcde", "cdef"]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 16,
        "total_tokens": 21,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_token_id_prompts_single_and_batched(fake):
    one = fake.post("/completions", prompt=[104, 105], max_tokens=2).json()
    assert len(one["choices"]) == 1 and one["usage"]["prompt_tokens"] == 2
    two = fake.post("/completions", prompt=[[104], [105, 106, 107]], max_tokens=2).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["usage"]["prompt_tokens"] == 4


def test_a_streamed_batch_sends_every_choice_and_one_usage(fake):
    chunks = fake.sse(
        "/completions",
        prompt=["x", "y", "z"],
        max_tokens=6,
        stream_options={"include_usage": True},
    )
    *items, usage, done = chunks
    texts: dict[int, str] = {}
    for chunk in items:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i: bytes(letters(None, 6)).decode() for i in range(3)}
    assert usage["usage"]["prompt_tokens"] == 3 and usage["usage"]["completion_tokens"] == 18


@pytest.mark.parametrize(
    ("prompt", "param", "fragment"),
    [
        (["ok", ""], "prompt.1", "must not be empty"),
        (["ok", "x" * 70], "prompt.1", "prompt 1:"),
        ([[1], [999]], "prompt.1", "outside the vocabulary"),
    ],
)
def test_a_bad_prompt_of_a_batch_is_named_by_its_index(fake, prompt, param, fragment):
    r = fake.post("/completions", prompt=prompt, max_tokens=2)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and fragment in err["message"], err


def test_more_generations_than_the_server_runs_at_once_is_400_not_429(fake):
    prompts = ["a"] * (LIMITS.max_inflight // 2 + 1)
    err = fake.post("/completions", prompt=prompts, n=2, max_tokens=2).json()["error"]
    assert err["param"] == "prompt" and "split the request" in err["message"]
    assert fake.engine.submitted == []


def test_tokenize_a_prompt_and_a_conversation(fake):
    r = fake.client.post("/tokenize", json={"model": "fake", "prompt": "hi"})
    assert r.json() == {
        "count": 2,
        "max_model_len": LIMITS.max_context_positions,
        "tokens": [104, 105],
    }
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    r = fake.client.post("/tokenize", json=chat)
    assert bytes(r.json()["tokens"]).decode() == "user: hi\n"
    with_tools = {
        **chat,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": True},
    }
    text = bytes(fake.client.post("/tokenize", json=with_tools).json()["tokens"]).decode()
    assert text == "tools: ['f']\nthink: on\nuser: hi\n"


def test_detokenize_round_trips(fake):
    r = fake.client.post("/detokenize", json={"model": "fake", "tokens": [104, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/detokenize", {"tokens": [104, -1]}, 400, "tokens", "-1 at position 1"),
        ("/detokenize", {"tokens": [LIMITS.vocab_size]}, 400, "tokens", "not in the vocabulary"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0", "integer"),
        ("/tokenize", {}, 400, "prompt", "exactly one of"),
        ("/tokenize", {"prompt": "a", "messages": []}, 400, "prompt", "exactly one of"),
        ("/tokenize", {"prompt": "a", "tools": []}, 400, "tools", "applies to 'messages'"),
        ("/tokenize", {"messages": []}, 400, "messages", "at least one message"),
        ("/tokenize", {"messages": [], "add_special_tokens": True}, 400, "add_special_tokens", ""),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model", "does not exist"),
    ],
)
def test_tokenizer_routes_reject_bad_input_by_name(fake, path, body, status, param, fragment):
    r = fake.client.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param and fragment in err["message"], err


def test_tokenizer_routes_need_the_api_key_when_one_is_set():
    server = make_fake_server(api_keys=("secret",))
    with server.client:
        assert server.client.post("/tokenize", json={"prompt": "a"}).status_code == 401
        ok = server.client.post(
            "/detokenize", json={"tokens": [97]}, headers={"Authorization": "Bearer secret"}
        )
        assert ok.status_code == 200 and ok.json() == {"prompt": "a"}
