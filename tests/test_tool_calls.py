"""Tool calling's text side, on hand-built replies: the hermes parser (whole and streamed, every
split), and how tools and calls are written into a template that does not know about them."""
from __future__ import annotations

import json

import pytest

from sluice.server.tool_calls import (
    ArgumentsDelta,
    NamedCallStream,
    ParsedToolCall,
    RequiredCallsStream,
    ToolCallStream,
    arguments_as_objects,
    messages_with_tools,
    named_call_schema,
    parse_required_calls,
    parse_tool_calls,
    required_calls_schema,
    template_handles_tools,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'


def call(name: str, **args) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(args))


def test_a_reply_with_text_and_two_calls():
    content, calls = parse_tool_calls("Let me check.\n" + WEATHER + "\n" + TIME)
    assert content == "Let me check.\n\n"
    assert calls == [call("get_weather", city="Paris", days=2), call("get_time", tz="CET")]
    assert json.loads(calls[1].arguments) == {"tz": "CET"}   # a JSON string of arguments is unwrapped


def test_only_calls_means_no_content():
    assert parse_tool_calls(WEATHER) == (None, [call("get_weather", city="Paris", days=2)])
    assert parse_tool_calls(WEATHER + "\n") == (None, [call("get_weather", city="Paris", days=2)])


def test_a_reply_without_calls_is_all_content():
    for text in ["", "Paris is the capital.", "a < b and <tool> is not a tag", "<tool_call"]:
        assert parse_tool_calls(text) == (text, [])


def test_an_unclosed_last_call_is_parsed_to_the_end():
    content, calls = parse_tool_calls('ok <tool_call>\n{"name": "f", "arguments": {}}\n')
    assert content == "ok " and calls == [call("f")]
    # Cut off in the middle of its JSON (max_tokens): left as text.
    cut = 'ok <tool_call>\n{"name": "f", "argu'
    assert parse_tool_calls(cut) == (cut, [])


@pytest.mark.parametrize("body", [
    "not json", "[1, 2]", '{"arguments": {}}', '{"name": 3}', '{"name": ""}',
    '{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "not json"}',
])
def test_a_block_that_is_not_a_call_stays_text(body):
    text = f"a<tool_call>{body}</tool_call>b"
    assert parse_tool_calls(text) == (text, [])


def test_missing_arguments_are_an_empty_object_and_parameters_is_accepted():
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[1] == [call("f")]
    assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>')[1] == [call("f", x=1)]


def merged(events):
    """Adjacent text events joined: how a split arrives is not part of the result."""
    out = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return [e for e in out if e != ""]


TEXTS = [
    "Let me check.\n" + WEATHER + "\n" + TIME + " done",
    WEATHER,
    "<<tool_call>" + WEATHER[len("<tool_call>"):],
    "x <tool_ca y",
    "a<tool_call>not json</tool_call>b" + TIME,
    'ok <tool_call>{"name": "f"}',
]


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_of_a_stream_gives_the_whole_texts_events(text):
    whole = ToolCallStream()
    expected = merged(whole.feed(text) + whole.finish())
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            s = ToolCallStream()
            events = s.feed(text[:i]) + s.feed(text[i:j]) + s.feed(text[j:]) + s.finish()
            assert merged(events) == expected, (i, j)
    s = ToolCallStream()
    assert merged([e for ch in text for e in s.feed(ch)] + s.finish()) == expected


def test_text_is_held_back_only_while_it_may_open_a_tag():
    s = ToolCallStream()
    assert s.feed("Hello <tool") == ["Hello "]
    assert s.feed("_ca") == []
    assert s.feed("t> x") == ["<tool_cat> x"]
    assert s.feed("<tool_call>") == []
    assert s.feed('{"name": "f"}') == []
    assert s.feed("</tool_call>!") == [call("f"), "!"]
    assert s.finish() == []


def test_templates_that_read_tools_get_them_as_they_are():
    assert template_handles_tools("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}...")
    assert not template_handles_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert not template_handles_tools(None)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tools_and_calls_are_written_into_plain_messages():
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    out = messages_with_tools(arguments_as_objects(history), TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    system = out[0]["content"]
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in system and "<tool_call>" in system
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(out[2]["content"])[1] == [call("get_weather", city="Paris")]
    assert out[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    assert history[2]["content"] == "18 C, sunny"                 # the caller's messages are not changed
    # A system message of the caller's own keeps its text first.
    out = messages_with_tools([{"role": "system", "content": "Be brief."}] + history, TOOLS)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and len(out) == 4
    # No tools: only the history is converted, no system message is added.
    assert [m["role"] for m in messages_with_tools(arguments_as_objects(history), None)] == ["user", "assistant", "tool"]


def test_an_assistant_calls_arguments_must_be_a_json_object():
    def history(arguments):
        return [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": arguments}}]}]
    assert arguments_as_objects(history("{}"))[0]["tool_calls"][0]["function"]["arguments"] == {}
    assert arguments_as_objects(history(""))[0]["tool_calls"][0]["function"]["arguments"] == {}
    assert arguments_as_objects(history({"a": 1}))[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    with pytest.raises(ValueError, match="not JSON"):
        arguments_as_objects(history("{oops"))
    with pytest.raises(ValueError, match="JSON object"):
        arguments_as_objects(history("[1]"))


def test_the_server_flags_are_checked_at_startup():
    import argparse

    from sluice.cli import add_server_args, build_server_config
    from sluice.config import ServerConfig

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    cfg = build_server_config(parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert cfg.enable_auto_tool_choice and cfg.tool_call_parser == "hermes"
    assert not build_server_config(parser.parse_args([])).enable_auto_tool_choice
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        build_server_config(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ServerConfig(tool_call_parser="pythonic")


# --- forced calls: tool_choice "required" and a named function ------------------------------------
REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Pa}]ris \\"{[\\\\", "days": 2}},\n'
            ' {"name": "get_time", "parameters": {}}]')


def test_required_calls_come_out_as_each_element_closes():
    s = RequiredCallsStream()
    first_end = REQUIRED.index("}},") + 2
    assert s.feed(REQUIRED[:first_end - 1]) == []         # braces and brackets inside strings don't count
    assert s.feed(REQUIRED[first_end - 1:first_end]) == [call("get_weather", city='Pa}]ris "{[\\', days=2)]
    assert s.feed(REQUIRED[first_end:]) == [call("get_time")]
    assert s.finish() == []
    assert parse_required_calls(REQUIRED) == [call("get_weather", city='Pa}]ris "{[\\', days=2), call("get_time")]


def test_every_split_of_a_required_reply_gives_the_same_calls():
    whole = RequiredCallsStream()
    expected = whole.feed(REQUIRED) + whole.finish()
    for i in range(len(REQUIRED) + 1):
        for j in range(i, len(REQUIRED) + 1, 5):
            s = RequiredCallsStream()
            assert s.feed(REQUIRED[:i]) + s.feed(REQUIRED[i:j]) + s.feed(REQUIRED[j:]) + s.finish() == expected


def test_a_required_reply_cut_short_keeps_its_complete_calls_or_is_text():
    cut = REQUIRED[:REQUIRED.index("get_time") + 5]
    s = RequiredCallsStream()
    assert s.feed(cut) + s.finish() == [call("get_weather", city='Pa}]ris "{[\\', days=2)]
    early = REQUIRED[:20]
    s = RequiredCallsStream()
    assert s.feed(early) + s.finish() == [early]
    assert parse_required_calls(early) is None


def test_forced_call_schemas():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "b"}}]
    assert named_call_schema(tools, "a") == tools[0]["function"]["parameters"]
    assert named_call_schema(tools, "b") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="not among the tools"):
        named_call_schema(tools, "c")
    schema = required_calls_schema(tools, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert required_calls_schema(tools, parallel=False)["maxItems"] == 1
    s = NamedCallStream("a")
    assert s.feed('{"x"') + s.feed("") + s.feed(": 1}") + s.finish() == [ArgumentsDelta("a", '{"x"'),
                                                                         ArgumentsDelta("a", ": 1}")]
