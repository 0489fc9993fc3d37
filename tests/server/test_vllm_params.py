"""vLLM's request fields that shape the output: stop_token_ids, include_stop_str_in_output,
skip_special_tokens, ignore_eos and stream_options.continuous_usage_stats, over a fake engine
(what the server makes of committed tokens) and the tiny checkpoint (the engine's cut)."""

from __future__ import annotations

import pytest

from engine import LLM, DecodeMode, SamplingParams
from tests.server.fake_engine import EOS

ANSWER = list(b"hello world, bye")
SPACE = ord(" ")


def text_of(fake, path: str = "/completions", **body) -> tuple[str, dict]:
    r = fake.post(path, prompt="p", **{"max_tokens": 16, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], r.json()


def test_a_stop_token_ends_the_text_before_it_and_counts_as_a_completion_token(fake):
    fake.engine.answer = ANSWER
    text, body = text_of(fake, stop_token_ids=[SPACE])
    assert text == "hello"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("hello ")
    assert fake.engine.submitted[-1].params.eos_token_ids == {EOS, SPACE}


def test_include_stop_str_in_output_keeps_the_stop_token_and_the_stop_string(fake):
    fake.engine.answer = ANSWER
    assert text_of(fake, stop_token_ids=[SPACE], include_stop_str_in_output=True)[0] == "hello "
    assert text_of(fake, stop=["wor"], include_stop_str_in_output=True)[0] == "hello wor"
    assert text_of(fake, stop=["wor"])[0] == "hello "


def test_a_stop_token_cuts_a_streamed_chat_too(fake):
    fake.engine.answer = ANSWER
    chunks = fake.sse(
        "/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=16,
        stop_token_ids=[ord(",")],
    )
    content = "".join(
        c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"]
    )
    assert content == "hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_a_request_under_ignore_eos(fake):
    fake.engine.answer = [*b"ab", EOS, *b"c d"]
    text, _ = text_of(fake, stop_token_ids=[SPACE], ignore_eos=True)
    assert text == "abc"
    assert fake.engine.submitted[-1].params.eos_token_ids == {SPACE}


def test_ignore_eos_runs_past_the_eos(fake):
    fake.engine.answer = [*b"ab", EOS, *b"cd"]
    assert text_of(fake)[0] == "ab"
    text, body = text_of(fake, ignore_eos=True, max_tokens=5)
    assert text == "abcd" and body["choices"][0]["finish_reason"] == "length"


def test_skip_special_tokens_false_spells_out_special_tokens(fake):
    fake.engine.answer = [*b"ab", EOS, *b"cd"]
    assert text_of(fake, ignore_eos=True, max_tokens=5, skip_special_tokens=False)[0] == "ab<eos>cd"
    # The EOS that ended the text is left out, as vLLM leaves it, unless asked for.
    assert text_of(fake, skip_special_tokens=False)[0] == "ab"
    kept = text_of(fake, skip_special_tokens=False, include_stop_str_in_output=True)[0]
    assert kept == "ab<eos>"


@pytest.mark.parametrize(
    ("ids", "fragment"), [([-1], "must be token ids"), ([4, 260], "must be in [0, 260)")]
)
def test_a_stop_token_id_outside_the_vocabulary_is_a_400(fake, ids, fragment):
    r = fake.post("/completions", prompt="p", stop_token_ids=ids)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "stop_token_ids" and fragment in error["message"]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(fake, path):
    fake.engine.answer, fake.engine.delay = ANSWER, 0.01  # a canvas per chunk
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = (
        {"prompt": "p"}
        if path == "/completions"
        else {"messages": [{"role": "user", "content": "p"}]}
    )
    chunks = fake.sse(path, max_tokens=12, stream_options=options, **body)[:-1]  # [DONE]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) >= 3
    plain = fake.sse(path, max_tokens=12, stream_options={"include_usage": True}, **body)[:-2]
    assert all(c["usage"] is None for c in plain)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM.from_pretrained(tiny_checkpoint("c16"))


@pytest.mark.parametrize("mode", [DecodeMode.DIFFUSION, DecodeMode.AR, DecodeMode.HYBRID])
def test_the_engine_cuts_at_the_first_stop_token_in_every_mode(llm, mode):
    free_params = {"mode": mode, "max_tokens": 16, "seed": 5, "ignore_eos": True}
    free_params["max_denoising_steps"] = 4  # a canvas of 16 in a few steps: a cheap test
    free = llm.generate([4, 5, 6], SamplingParams(**free_params))[0].output_ids
    stop = free[7]  # inside the canvas: the canvas is cut there
    cut = llm.generate([4, 5, 6], SamplingParams(**free_params, stop_token_ids=(stop,)))[0]
    assert cut.output_ids == free[: free.index(stop) + 1]
    assert cut.finish_reason == "stop"
