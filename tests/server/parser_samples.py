"""Recorded model outputs in DiffusionGemma's (Gemma 4's) format, shared by the parser, tools
and OpenAI-feature tests."""

# Outputs in DiffusionGemma's (Gemma 4's) format, as the checkpoint writes them.
THINK_THEN_CALLS = (
    "<|channel>thought\nThe user wants the weather in two cities; call the tool twice.<channel|>"
    '<|tool_call>call:get_weather{location:<|"|>San Francisco, CA<|"|>,unit:<|"|>celsius<|"|>}'
    "<tool_call|>"
    '<|tool_call>call:get_weather{location:<|"|>Tokyo<|"|>,unit:<|"|>celsius<|"|>}<tool_call|>'
    "<|tool_response>"
)
CONTENT_AND_NESTED_CALL = (
    "Let me book that.\n"
    '<|tool_call>call:book_flight{from:<|"|>SFO<|"|>,to:<|"|>NRT<|"|>,passengers:2,'
    'window:true,fare:1234.5,note:null,legs:[{day:<|"|>mon<|"|>,seat:<|"|>12A, aisle: no}<|"|>},'
    '{day:<|"|>fri<|"|>,seat:7}],tags:[<|"|>a<|"|>,<|"|>b<|"|>]}<tool_call|>'
)
THOUGHT_AND_ANSWER = "<|channel>thought\nSimple arithmetic.<channel|>2 + 2 = 4.<turn|>ignored"
RECORDED = [THINK_THEN_CALLS, CONTENT_AND_NESTED_CALL, THOUGHT_AND_ANSWER]
