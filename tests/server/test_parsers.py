"""The Gemma 4 output parsers on recorded outputs, whole and fed in arbitrary chunks."""

from __future__ import annotations

import json
import random

import pytest

from server.parsers import (
    Gemma4Parser,
    NamedCallParser,
    Parsed,
    RequiredCallsParser,
    join_tool_calls,
    parse_call,
)
from tests.server.parser_samples import (
    CONTENT_AND_NESTED_CALL,
    RECORDED,
    THINK_THEN_CALLS,
    THOUGHT_AND_ANSWER,
)


def parse(chunks: list[str], tools: bool = True, max_calls: int | None = None) -> Parsed:
    parser = Gemma4Parser(tools, max_calls)
    out = Parsed()
    for chunk in chunks:
        out.merge(parser.feed(chunk))
    out.merge(parser.finish())
    return out


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in join_tool_calls(parsed.tool_calls)
    ]


def test_thoughts_and_two_tool_calls_are_split_from_the_content():
    out = parse([THINK_THEN_CALLS])
    assert out.reasoning == "The user wants the weather in two cities; call the tool twice."
    assert out.content == ""
    assert calls(out) == [
        ("get_weather", {"location": "San Francisco, CA", "unit": "celsius"}),
        ("get_weather", {"location": "Tokyo", "unit": "celsius"}),
    ]
    ids = [c["id"] for c in join_tool_calls(out.tool_calls)]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_nested_arguments_keep_their_json_types_and_delimited_strings_keep_punctuation():
    out = parse([CONTENT_AND_NESTED_CALL])
    assert out.content == "Let me book that.\n" and out.reasoning == ""
    ((name, arguments),) = calls(out)
    assert name == "book_flight"
    assert arguments == {
        "from": "SFO",
        "to": "NRT",
        "passengers": 2,
        "window": True,
        "fare": 1234.5,
        "note": None,
        "legs": [{"day": "mon", "seat": "12A, aisle: no}"}, {"day": "fri", "seat": 7}],
        "tags": ["a", "b"],
    }


def test_the_turn_end_ends_the_answer():
    out = parse([THOUGHT_AND_ANSWER])
    assert (out.reasoning, out.content, out.tool_calls) == ("Simple arithmetic.", "2 + 2 = 4.", [])


@pytest.mark.parametrize("text", RECORDED)
def test_any_chunking_gives_the_same_result_as_the_whole_text(text):
    whole = parse([text])
    for seed in range(60):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(40, len(text) - 1))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out = parse(chunks)
        assert (out.content, out.reasoning, calls(out)) == (
            whole.content,
            whole.reasoning,
            calls(whole),
        ), chunks
    one_by_one = parse(list(text))
    assert (one_by_one.content, one_by_one.reasoning) == (whole.content, whole.reasoning)


def test_a_partial_marker_is_held_back_until_the_next_chunk_decides():
    parser = Gemma4Parser(tools=True)
    assert parser.feed("Hello <|tool").content == "Hello "
    assert parser.feed("box> done").content == "<|toolbox> done"  # not a marker after all
    parser = Gemma4Parser(tools=True)
    assert parser.feed("<|channel>thou").reasoning == ""  # may still be the label
    assert parser.feed("ght\nhm").reasoning == "hm"


def test_tool_call_markup_is_content_when_the_request_has_no_tools():
    out = parse([CONTENT_AND_NESTED_CALL], tools=False)
    assert out.tool_calls == [] and out.content == CONTENT_AND_NESTED_CALL


def test_a_malformed_or_cut_off_call_is_kept_as_content():
    bad = '<|tool_call>call:f{a:<|"|>x}<tool_call|>'  # unterminated string
    assert parse([bad]).content == bad and parse([bad]).tool_calls == []
    cut = "ok <|tool_call>call:f{a:1"
    out = parse([cut[:10], cut[10:]])
    assert out.content == cut and out.tool_calls == []
    assert parse(["ok <|tool_call>"]).content == "ok <|tool_call>"  # cut right after the marker


def test_an_unterminated_thought_is_all_reasoning():
    out = parse(["<|channel>thought\nstill thinking", " when the budget ran out"])
    assert out.reasoning == "still thinking when the budget ran out" and out.content == ""


def test_reasoning_spans_cover_the_thought_markup():
    parser = Gemma4Parser(tools=True)
    parser.feed("Hi <|channel>thought\nx<channel|>done")
    parser.finish()
    ((start, end),) = parser.reasoning_spans
    assert "Hi <|channel>thought\nx<channel|>done"[start:end] == "<|channel>thought\nx<channel|>"


def test_max_calls_keeps_only_the_first_call():
    assert [n for n, _ in calls(parse([THINK_THEN_CALLS], max_calls=1))] == ["get_weather"]


@pytest.mark.parametrize(
    "body",
    ["call:f", "f{}", "call:{}", "call:f{a}", "call:f{a:1,,}", "call:f{a:1} extra", "call:f{a:[1}"],
)
def test_parse_call_rejects_malformed_bodies(body):
    with pytest.raises(ValueError):
        parse_call(body)


def test_parse_call_reads_quoted_keys_and_empty_containers():
    assert parse_call('call:f{<|"|>a b<|"|>:{},c:[],d:-3e2,e:NaN}') == (
        "f",
        {"a b": {}, "c": [], "d": -300.0, "e": "NaN"},
    )


def test_a_named_call_streams_its_arguments_under_one_id():
    parser = NamedCallParser("get_weather")
    first, second = parser.feed('{"city": '), parser.feed('"Paris"}')
    rest = parser.finish()
    (head,), (tail,) = first.tool_calls, second.tool_calls
    assert head.name == "get_weather" and head.id and tail.id is None and not rest
    (call,) = join_tool_calls(first.tool_calls + second.tool_calls)
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_required_calls_parse_the_json_array_or_fall_back_to_content():
    parser = RequiredCallsParser()
    parser.feed('[{"name": "a", "arguments": {"x": 1}}, ')
    parser.feed('{"name": "b", "arguments": {}}]')
    out = parser.finish()
    assert calls(out) == [("a", {"x": 1}), ("b", {})] and out.content == ""
    cut = RequiredCallsParser()
    cut.feed('[{"name": "a", "argu')
    assert cut.finish().content == '[{"name": "a", "argu'
