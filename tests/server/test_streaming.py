"""Streaming over the fake engine: one chunk per canvas, usage, n > 1, stop strings and
max_tokens cut inside a canvas, drafts, in-band errors, [DONE]; and the output collector that
keeps a slow reader's memory bounded."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.types import FinishReason, StepOutput
from server.errors import ClientGone
from server.parsers import Parsed
from server.stream import ChoiceEvent, OutputCollector
from tests.server.fake_engine import FakeEngine, make_run

CHAT = [{"role": "user", "content": "hi"}]


def choices(chunks: list) -> list[dict]:
    return [c for chunk in chunks if chunk != "[DONE]" for c in chunk["choices"]]


def test_a_stream_is_one_chunk_per_canvas_then_done(fake):
    chunks = fake.sse("/completions", prompt="a", max_tokens=10)
    assert chunks[-1] == "[DONE]"
    items = choices(chunks)
    # A reader that keeps up gets one chunk per canvas; a slow one gets them coalesced.
    assert 1 <= len(items) <= 3 and "".join(c["text"] for c in items) == "abcdefghij"
    assert [c["finish_reason"] for c in items][-1] == "length"
    assert sum(c["finish_reason"] is not None for c in items) == 1
    assert items[-1]["canvas_stats"]["steps_per_canvas"] == [3, 3, 3]
    assert all("usage" not in c for c in chunks[:-1])


def test_a_chat_stream_opens_with_the_role(fake):
    items = choices(fake.sse("/chat/completions", messages=CHAT, max_tokens=4))
    assert items[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["delta"].get("content", "") for c in items) == "abcd"
    assert all("role" not in c["delta"] for c in items[1:])


def test_the_usage_chunk_comes_last_and_earlier_chunks_carry_null_usage(fake):
    chunks = fake.sse(
        "/chat/completions",
        messages=CHAT,
        max_tokens=6,
        stream_options={"include_usage": True},
    )
    *content, usage, done = chunks
    assert done == "[DONE]" and usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 6,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
    assert all(c["usage"] is None for c in content)


def test_n_choices_stream_side_by_side(fake):
    items = choices(fake.sse("/completions", prompt="a", max_tokens=5, n=2, seed=1))
    for index, text in ((0, "bcdef"), (1, "cdefg")):
        mine = [c for c in items if c["index"] == index]
        assert "".join(c["text"] for c in mine) == text
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert sum(c["finish_reason"] is not None for c in mine) == 1


def test_a_stop_string_inside_a_canvas_cuts_the_stream(fake):
    items = choices(fake.sse("/completions", prompt="a", max_tokens=12, stop=["fg"]))
    assert [c["text"] for c in items] == ["abcd", "e"]
    assert items[-1]["finish_reason"] == "stop"


def test_a_stop_string_split_across_canvases_is_held_back(fake):
    items = choices(fake.sse("/completions", prompt="a", max_tokens=12, stop=["de"]))
    assert "".join(c["text"] for c in items) == "abc"
    assert items[-1]["finish_reason"] == "stop"


def test_drafts_ride_in_their_own_field_and_content_only_appends(fake):
    fake.engine.drafts_per_canvas = 2
    items = choices(fake.sse("/completions", prompt="a", max_tokens=8, stream_drafts=True))
    drafts = [c["draft"] for c in items if "draft" in c]
    assert drafts and set(drafts) <= {"0000", "1111"}  # a slow reader sees only the newest
    assert "draft" not in items[-1] and items[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in items) == "abcdefgh"
    assert fake.engine.submitted[0].want_drafts


def test_a_verify_pass_streams_its_draft_and_verdict(fake):
    """Hybrid: the chunk of a verify pass names the draft it saw, one string per position,
    and how many positions it accepted (the text commits those, then the verifier's token)."""

    async def outputs(request_id, prompt_ids, params, want_drafts):  # type: ignore[no-untyped-def]
        verified, accepted = (list(b"axy"), 1) if want_drafts else (None, None)  # as the engine
        yield StepOutput(request_id, list(b"ab"), verified=verified, accepted=accepted)
        yield StepOutput(request_id, list(b"c"), FinishReason.LENGTH, stats=None)

    fake.engine._outputs = outputs
    items = choices(fake.sse("/completions", prompt="a", max_tokens=3, stream_drafts=True))
    assert "".join(c["text"] for c in items) == "abc"
    verdicts = [c["verified"] for c in items if "verified" in c]
    assert verdicts == [{"draft_tokens": ["a", "x", "y"], "accepted": 1}]
    plain = choices(fake.sse("/completions", prompt="a", max_tokens=3))
    assert "".join(c["text"] for c in plain) == "abc" and all("verified" not in c for c in plain)


def test_an_engine_fault_mid_stream_is_reported_in_band_then_done(fake):
    fake.engine.fail_after = 1
    chunks = fake.client.post(
        "/v1/completions",
        json={"model": "fake", "prompt": "a", "max_tokens": 12, "stream": True},
        headers={"x-request-id": "r1"},
    ).text.split("\n\n")
    response_id = json.loads(chunks[0].removeprefix("data: "))["id"]
    assert response_id.startswith("cmpl-") and '"text":"abcd"' in chunks[0]
    assert chunks[1].startswith('data: {"error":')
    assert f"Engine error for request {response_id}: internal engine error" in chunks[1]
    assert chunks[2] == "data: [DONE]"


def test_closing_a_stream_aborts_every_choice():
    async def main() -> list[str]:
        engine = FakeEngine(delay=0.01)
        run = make_run(engine, num_choices=2)
        await run.open()
        stream = run.sse()
        assert '"text":"abcd"' in await anext(stream)
        await stream.aclose()  # what Starlette does when the client goes away
        return engine.aborted

    assert sorted(asyncio.run(main())) == ["cmpl-x-0", "cmpl-x-1"]


def test_a_client_gone_before_the_answer_aborts_its_request():
    class Gone:
        async def is_disconnected(self) -> bool:
            return True

    async def main() -> list[str]:
        engine = FakeEngine(delay=0.05)
        run = make_run(engine, num_choices=1)
        await run.open()
        with pytest.raises(ClientGone):
            await run.complete(Gone())  # type: ignore[arg-type]
        return engine.aborted

    assert asyncio.run(main()) == ["cmpl-x-0"]


def test_a_slow_reader_gets_one_coalesced_event_per_choice():
    async def main() -> list[ChoiceEvent] | None:
        sink = OutputCollector(2)
        for step in range(1000):  # drafts of a reader that never keeps up: memory stays flat
            sink.put(ChoiceEvent(0, draft_ids=[step]))
        sink.put(ChoiceEvent(1, Parsed("xy")))
        sink.put(ChoiceEvent(0, Parsed("ab"), draft_ids=None))
        sink.put(ChoiceEvent(0, Parsed("cd"), draft_ids=[7]))
        sink.put(ChoiceEvent(1, Parsed("z"), finish_reason=FinishReason.LENGTH))
        return await sink.get()

    first, second = asyncio.run(main()) or []
    assert (first.index, first.delta.content, first.draft_ids, first.finish_reason) == (
        0,
        "abcd",
        [7],
        None,
    )
    assert (second.delta.content, second.finish_reason) == ("xyz", FinishReason.LENGTH)


def test_the_collector_hands_out_pending_events_before_a_failure_then_ends():
    async def main() -> list:
        sink = OutputCollector(1)
        sink.put(ChoiceEvent(0, Parsed("ab")))
        sink.fail(RuntimeError("boom"))
        sink.close()
        got: list = [await sink.get()]
        with pytest.raises(RuntimeError, match="boom"):
            await sink.get()
        done = OutputCollector(1)
        done.close()
        got.append(await done.get())
        return got

    events, end = asyncio.run(main())
    assert [e.delta.content for e in events] == ["ab"] and end is None
