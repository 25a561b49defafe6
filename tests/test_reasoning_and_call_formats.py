"""The reasoning split (`--reasoning-parser`) and the GLM and Qwen XML tool-call formats
(`--tool-call-parser glm45|glm47|qwen3_coder|qwen3_xml`) on hand-built replies: whole and split at
every point, the split's events are the whole text's."""
from __future__ import annotations

import json
from typing import Any, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.server.reasoning import ReasoningDelta, ReasoningStream, reasoning_text, starts_in_reasoning
from sluice.server.tool_calls import (
    ParsedToolCall, ToolCallStream, call_parser_factory, glm_call_parser, prepare_chat, qwen_xml_call_parser,
    schema_types, typed_value,
)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "lat": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
    "opts": {"type": "object"}, "note": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "now"}}]


def merged(events: list[Any]) -> list[Any]:
    """Events with neighbouring text and neighbouring reasoning joined (how a split is compared)."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        elif isinstance(e, ReasoningDelta) and out and isinstance(out[-1], ReasoningDelta):
            out[-1] = ReasoningDelta(out[-1].text + e.text)
        elif e != "" and e != ReasoningDelta(""):
            out.append(e)
    return out


def run(parser, text: str, cuts: tuple[int, ...] = ()) -> list[Any]:
    events, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return merged(events + parser.finish())


def reasoning(in_reasoning: bool, tools: bool = False, keep: bool = True) -> ReasoningStream:
    return ReasoningStream(in_reasoning, call_parser_factory("glm47", TOOLS) if tools else None, keep)


CASES = [
    # (starts in reasoning, with GLM tools, reply) -> events
    (True, False, "Two and two.</think>\n\nFour.", [ReasoningDelta("Two and two."), "\n\nFour."]),
    (True, False, "cut short, no end", [ReasoningDelta("cut short, no end")]),
    (False, False, "<think>hm</think>Yes.", [ReasoningDelta("hm"), "Yes."]),
    (False, False, "Plain answer.", ["Plain answer."]),
    (False, False, "stray</think> end", ["stray end"]),
    (False, False, "a < b and <thin", ["a < b and <thin"]),
    (True, True, "Need weather.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
     [ReasoningDelta("Need weather."), ParsedToolCall("get_weather", '{"city": "Paris"}')]),
    # a call straight out of the thought ends it
    (True, True, "Need time.<tool_call>now</tool_call>", [ReasoningDelta("Need time."), ParsedToolCall("now", "{}")]),
    # the price of that rule: a thought that mentions the tag ends there (the stray end is dropped)
    (True, True, "Use <tool_call> tags?</think>No.", [ReasoningDelta("Use "), "<tool_call> tags?No."]),
]


@pytest.mark.parametrize("in_reasoning, tools, text, expected", CASES)
def test_reasoning_split_whole_and_at_every_point(in_reasoning, tools, text, expected):
    assert run(reasoning(in_reasoning, tools), text) == expected
    for cut in range(len(text) + 1):
        assert run(reasoning(in_reasoning, tools), text, (cut,)) == expected, cut


@settings(max_examples=300, deadline=None)
@given(data=st.data(), pieces=st.lists(st.sampled_from(
    ["<think>", "</think>", "<tool_call>", "</tool_call>", "now", "get_weather", "<arg_key>", "</arg_key>",
     "city", "<arg_value>", "</arg_value>", "Paris", " ", "\n", "<", "think", ">", "x"]), max_size=20),
    in_reasoning=st.booleans(), tools=st.booleans())
def test_any_split_gives_the_whole_texts_events(data, pieces, in_reasoning, tools):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    assert run(reasoning(in_reasoning, tools), text, tuple(cuts)) == run(reasoning(in_reasoning, tools), text)


LEADING = [
    # a constrained reply (`leading`): one thought at most, at its start; then every character is content
    (True, 'cut short <think>', [ReasoningDelta('cut short <think>')]),
    (True, 'Hm.</think>{"a": "</think><think>x"}', [ReasoningDelta("Hm."), '{"a": "</think><think>x"}']),
    (False, '<think>Hm.</think>{"a": "<think>"}', [ReasoningDelta("Hm."), '{"a": "<think>"}']),
    (False, ' <think>{"a": 1}', [' <think>{"a": 1}']),        # only the very first text opens one
    (False, '{"a": "</think>"}', ['{"a": "</think>"}']),
    (False, "<thin", ["<thin"]),                               # held while it could be the tag, then text
]


@pytest.mark.parametrize("in_reasoning, text, expected", LEADING)
def test_a_constrained_reply_has_one_leading_thought_at_most(in_reasoning, text, expected):
    for cut in [None, *range(len(text) + 1)]:
        parser = ReasoningStream(in_reasoning, None, True, leading=True)
        assert run(parser, text, () if cut is None else (cut,)) == expected, cut


def test_reasoning_left_out_and_read_whole():
    text = "<think>secret</think>Answer."
    assert run(reasoning(False, keep=False), text) == ["Answer."]
    events = reasoning(False).feed(text)
    assert reasoning_text(events) == "secret" and reasoning_text(["only text"]) is None


@pytest.mark.parametrize("tail, expected", [
    ("<|assistant|><think>", True),                      # GLM-5.x: the generation prompt opens it
    ("<｜Assistant｜><think>\n", True),                    # DeepSeek-R1
    ("<|assistant|><think></think>", False),             # thinking turned off by the template
    ("<|im_start|>assistant\n", False),
    ("<think>a</think>b<|user|>q<|assistant|>", False),  # an earlier turn's closed thought
    ("<|assistant|><think>Let me see", True),            # a response prefill inside the thought
])
def test_where_a_reply_starts(tail, expected):
    assert starts_in_reasoning(tail) is expected


# --- the GLM format ------------------------------------------------------------------------------

def glm(body: str) -> Optional[ParsedToolCall]:
    return glm_call_parser(TOOLS)(body)


def test_glm_call_values_are_typed_by_the_tools_schema():
    call = glm("get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
               "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value>"
               "<arg_key>lat</arg_key><arg_value>40.7</arg_value><arg_key>tags</arg_key><arg_value>[\"a\", \"b\"]</arg_value>"
               "<arg_key>opts</arg_key><arg_value>{\"x\": 1}</arg_value><arg_key>note</arg_key><arg_value>null</arg_value>"
               "<arg_key>unit</arg_key><arg_value>c</arg_value><arg_key>extra</arg_key><arg_value>7</arg_value>\n")
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "New York", "days": 3, "metric": True, "lat": 40.7, "tags": ["a", "b"],
                                          "opts": {"x": 1}, "note": None, "unit": "c", "extra": "7"}


def test_glm_values_that_do_not_fit_stay_text():
    call = glm("get_weather<arg_key>days</arg_key><arg_value>three</arg_value>"
               "<arg_key>metric</arg_key><arg_value>yes</arg_value><arg_key>tags</arg_key><arg_value>[1,</arg_value>"
               "<arg_key>city</arg_key><arg_value> 12 </arg_value>")
    assert json.loads(call.arguments) == {"days": "three", "metric": "yes", "tags": "[1,", "city": " 12 "}


@pytest.mark.parametrize("body", [
    "unknown_tool<arg_key>a</arg_key><arg_value>1</arg_value>",   # not one of the request's tools
    "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value> and more",
    "get_weather<arg_key>city</arg_key>",                          # cut short
    "",
])
def test_glm_blocks_that_are_not_calls(body):
    assert glm(body) is None


def test_glm_calls_in_a_stream_and_a_block_that_is_not_one():
    parse = call_parser_factory("glm45", TOOLS)
    text = ("Checking.<tool_call>now</tool_call><tool_call>get_weather<arg_key>days</arg_key><arg_value>2</arg_value>"
            "</tool_call><tool_call>nope</tool_call>")
    expected = ["Checking.", ParsedToolCall("now", "{}"), ParsedToolCall("get_weather", '{"days": 2}'),
                "<tool_call>nope</tool_call>"]
    for cut in range(len(text) + 1):
        assert run(parse(), text, (cut,)) == expected
    assert isinstance(call_parser_factory("hermes", TOOLS)(), ToolCallStream)


@pytest.mark.parametrize("schema, types", [
    ({"type": ["integer", "null"]}, {"integer", "null"}),
    ({"enum": [1, "a", None, True]}, {"integer", "string", "null", "boolean"}),
    ({"oneOf": [{"type": "number"}, {"type": "array"}]}, {"number", "array"}),
    ({"description": "no type"}, {"string"}),
])
def test_schema_types(schema, types):
    assert schema_types(schema) == types


def test_typed_value_order_and_non_finite_numbers():
    assert typed_value("5", {"integer", "string"}) == 5
    assert typed_value("5", {"string", "number"}) == 5 and typed_value("5.5", {"number"}) == 5.5
    assert typed_value("1e999", {"number"}) == "1e999"
    assert typed_value("null", {"null", "string"}) is None and typed_value("nil", {"null"}) == "nil"


def test_an_assistant_turns_reasoning_reaches_the_template_under_both_names():
    from sluice.server.protocol import ChatMessage

    for field in ("reasoning", "reasoning_content"):
        m = ChatMessage.model_validate({"role": "assistant", "content": "4.", field: "2 and 2."}).to_template_dict()
        assert (m["reasoning"], m["reasoning_content"], m["content"]) == ("2 and 2.", "2 and 2.", "4.")
    user = ChatMessage.model_validate({"role": "user", "content": "q", "reasoning": "x"}).to_template_dict()
    assert "reasoning_content" not in user


def test_glm_calls_in_the_history_are_written_in_glm_format_for_a_template_without_tools():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]}]
    out, tools = prepare_chat(messages, TOOLS, "{{ messages }}", "glm")
    assert tools is None and "<arg_key>" in out[0]["content"]          # the convention, in the system message
    body = out[2]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert glm(body) == ParsedToolCall("get_weather", '{"city": "Paris", "days": 2}')   # what it writes, it reads


# --- the Qwen XML format ---------------------------------------------------------------------------

QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
             "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")


def test_qwen_xml_calls_whole_and_split_at_every_point():
    parse = call_parser_factory("qwen3_coder", TOOLS)
    text = "Let me check.\n" + QWEN_CALL + "\n<tool_call>\n<function=now>\n</function>\n</tool_call>"
    expected = ["Let me check.\n",
                ParsedToolCall("get_weather", json.dumps({"city": "New York", "days": 3, "tags": ["a"],
                                                          "note": "line one\nline two"})),
                "\n", ParsedToolCall("now", "{}")]
    for cut in range(len(text) + 1):
        assert run(parse(), text, (cut,)) == expected, cut
    assert call_parser_factory("qwen3_xml", TOOLS)().feed(QWEN_CALL) == expected[1:2]


@pytest.mark.parametrize("body", [
    "\n<function=unknown>\n</function>\n",
    "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nmore text\n</function>\n",
    "\n<function=get_weather>\n<parameter=city>\nParis\n",                 # cut short
    "get_weather",
])
def test_qwen_xml_blocks_that_are_not_calls(body):
    assert qwen_xml_call_parser(TOOLS)(body) is None


def test_qwen_xml_calls_in_the_history_round_trip():
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "tags": ["x"]}'}}]}]
    out, _ = prepare_chat(messages, TOOLS, "{{ messages }}", "qwen_xml")
    assert "<parameter=" in out[0]["content"]
    body = out[1]["content"].removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert qwen_xml_call_parser(TOOLS)(body) == ParsedToolCall("get_weather", '{"city": "Paris", "days": 2, "tags": ["x"]}')
