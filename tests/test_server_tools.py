"""Tool calling through a real server (`--enable-auto-tool-choice --tool-call-parser hermes`),
driven by the official `openai` client: the calls the default model writes come back as
`tool_calls`, streamed or not, and an agent's round trip (call, tool result, next call) works."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from server_utils import RemoteServer
from sluice.server.tool_calls import parse_tool_calls

SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# One worked example in the history, then a new question: greedy decoding of the default model
# follows the example and calls the tool (checked below against its raw text, not assumed).
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "What is the weather in Berlin?"},
]
GREEDY: dict[str, Any] = {"max_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="module")
def raw(client: openai.OpenAI, model: str):
    """The same prompt with tool_choice "none": the tools are rendered, the reply is not parsed."""
    resp = client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, tool_choice="none", **GREEDY)
    assert resp.choices[0].message.tool_calls in (None, [])
    return resp


def calls_of(message) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_the_models_tool_call_comes_back_as_tool_calls(client: openai.OpenAI, model: str, raw) -> None:
    text = raw.choices[0].message.content
    content, expected = parse_tool_calls(text)
    assert expected, f"the few-shot prompt no longer makes the model call the tool: {text!r}"
    resp = client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, **GREEDY)
    choice = resp.choices[0]
    assert calls_of(choice.message) == [(c.name, json.loads(c.arguments)) for c in expected]
    assert calls_of(choice.message)[0][0] == "get_weather"
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == len(expected)
    assert choice.message.content == content
    assert choice.finish_reason == ("tool_calls" if raw.choices[0].finish_reason == "stop" else "length")
    assert resp.usage.prompt_tokens == raw.usage.prompt_tokens
    assert resp.usage.completion_tokens == raw.usage.completion_tokens


def test_streamed_tool_calls_match_the_whole_reply(client: openai.OpenAI, model: str, raw) -> None:
    whole = client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=FEW_SHOT, tools=TOOLS, stream=True, **GREEDY))
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for c in chunks:
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            acc["id"] += tc.id or ""
            acc["name"] += tc.function.name or ""
            acc["arguments"] += tc.function.arguments or ""
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == calls_of(whole.choices[0].message)
    assert sorted(calls) == list(range(len(calls))) and all(c["id"].startswith("call_") for c in calls.values())
    assert content.strip() == (whole.choices[0].message.content or "").strip()
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_an_agent_round_trip_reuses_the_cached_prefix(client: openai.OpenAI, model: str, raw) -> None:
    """Call, answer the call with a tool result, call again: the assistant message the client
    got back goes into the history as it is, and the next prompt extends the previous one."""
    messages = list(FEW_SHOT)
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **GREEDY)
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message)                         # the openai client's own message object
    messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "9 C, rain"})
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **GREEDY)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 5
    # Everything up to the first call's reply is cached (block granular, or its retained tail).
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_without_tools_nothing_is_parsed(client: openai.OpenAI, model: str, raw) -> None:
    """The same history without tools: the tool signatures are not in the prompt, and a reply is
    plain content whatever it contains."""
    plain = client.chat.completions.create(model=model, messages=FEW_SHOT, **GREEDY)
    assert plain.choices[0].message.tool_calls in (None, [])
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert raw.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def post(server: RemoteServer, **body: Any) -> httpx.Response:
    body = {"messages": FEW_SHOT, "max_tokens": 4, **body}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages"),
], ids=["named_not_a_tool", "forced_with_response_format", "choice_without_tools", "unknown_choice", "not_a_function", "bad_name",
        "no_name", "tools_not_a_list", "history_arguments_not_json", "history_call_without_function"])
def test_bad_tool_requests_are_400(server: RemoteServer, body: dict[str, Any], param: str) -> None:
    resp = post(server, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert post(server).status_code == 200            # and the server is fine
