"""Whole-canvas deltas broke peers' reasoning and tool parsers: the Gemma 4 parser fed a
canvas at a time (every cut a canvas of 16, 32 or 256 characters makes) never leaks the thought
markup into the reasoning, never swallows a call it cannot read, and escapes quotes in string
arguments."""

from __future__ import annotations

import json

import pytest

from server.parsers import Gemma4Parser, Parsed, join_tool_calls

CANVASES = (16, 32, 256)


def parse_by_canvas(text: str, size: int) -> Parsed:
    parser = Gemma4Parser(True, None)
    out = Parsed()
    for start in range(0, len(text), size):
        out.merge(parser.feed(text[start : start + size]))
    out.merge(parser.finish())
    return out


@pytest.mark.parametrize("size", CANVASES)
def test_the_thought_markup_never_reaches_the_reasoning(size: int):
    text = "<|channel>thought\nCompare the two options first.<channel|>Option B."
    out = parse_by_canvas(text, size)
    assert out.reasoning == "Compare the two options first."
    assert out.content == "Option B."


@pytest.mark.parametrize("size", CANVASES)
def test_a_paren_form_call_is_kept_as_content_not_swallowed(size: int):
    text = 'Checking. <|tool_call>call:get_weather(location="Paris")<tool_call|>'
    out = parse_by_canvas(text, size)
    assert out.tool_calls == [] and out.content == text


@pytest.mark.parametrize("size", CANVASES)
def test_quotes_and_backslashes_in_string_arguments_stay_valid_json(size: int):
    text = '<|tool_call>call:say{text:<|"|>he said "hi", then \\ left<|"|>,n:2}<tool_call|>'
    out = parse_by_canvas(text, size)
    (call,) = join_tool_calls(out.tool_calls)
    assert call["function"]["name"] == "say"
    assert json.loads(call["function"]["arguments"]) == {
        "text": 'he said "hi", then \\ left',
        "n": 2,
    }
