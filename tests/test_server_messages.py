"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through a real server, driven
by the official `anthropic` client: a message is the chat completion it amounts to (same prompt,
same reply), streamed or not; tool_use and tool_result blocks make an agent's round trip; errors
come in Anthropic's shape."""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from server_utils import RemoteServer

API_KEY = "sk-messages-test"
SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-key", API_KEY]
SYSTEM = "You are a concise assistant."
QUESTION = [{"role": "user", "content": "Give me three tips for staying focused."}]
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
GREEDY = {"temperature": 0}   # (the anthropic client no longer has a temperature argument)
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
# A worked example in the history (a call, without its result: with one, this small model answers
# with a made-up tool response), then a new question: greedy decoding of the default model follows
# the example and calls the tool (test_server_tools' chat history, as Messages).
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather in Berlin?"}]},
]
CHAT_FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "toolu_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "What is the weather in Berlin?"},
]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server: RemoteServer) -> anthropic.Anthropic:
    """The anthropic client sends its key as x-api-key."""
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def test_a_message_is_the_chat_completion_it_amounts_to(claude: anthropic.Anthropic, client: openai.OpenAI,
                                                          model: str) -> None:
    for max_tokens in (12, 200):
        msg = claude.messages.create(model=model, system=SYSTEM, messages=QUESTION, max_tokens=max_tokens,
                                     extra_body=GREEDY)
        chat = client.chat.completions.create(model=model, temperature=0, max_tokens=max_tokens,
                                              messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
        assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.model == model
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
        assert msg.usage.output_tokens == chat.usage.completion_tokens
        expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
        assert msg.stop_reason == expected and msg.stop_sequence is None
    # the same conversation again: its prompt is served from the prefix cache
    again = claude.messages.create(model=model, system=SYSTEM, messages=QUESTION, max_tokens=1)
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_the_stream_rebuilds_the_message(server: RemoteServer, claude: anthropic.Anthropic, model: str) -> None:
    fields: dict[str, Any] = dict(model=model, system=SYSTEM, messages=QUESTION, max_tokens=40, extra_body=GREEDY)
    whole = claude.messages.create(**fields)
    with claude.messages.stream(**fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    events = [e.type for e in claude.messages.create(stream=True, **fields)]   # (the client drops pings)
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    body = {"model": model, "messages": QUESTION, "max_tokens": 4, "stream": True}
    raw = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60).text
    frames = [f.split("\n") for f in raw.strip().split("\n\n")]
    assert all(len(f) == 2 and f[0].startswith("event: ") and f[1].startswith("data: ") for f in frames), raw
    assert [f[0].removeprefix("event: ") for f in frames] == [json.loads(f[1].removeprefix("data: "))["type"] for f in frames]
    assert frames[1][0] == "event: ping"


def test_stop_sequences(claude: anthropic.Anthropic, model: str) -> None:
    free = claude.messages.create(model=model, messages=QUESTION, max_tokens=40, extra_body=GREEDY).content[0].text
    stop = free[len(free) // 2:len(free) // 2 + 4]
    msg = claude.messages.create(model=model, messages=QUESTION, max_tokens=40, extra_body=GREEDY, stop_sequences=[stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == free[:free.index(stop)]


def test_a_tool_call_and_its_result(claude: anthropic.Anthropic, client: openai.OpenAI, model: str) -> None:
    """The model's call comes back as a tool_use block (whole and streamed), as the chat endpoint
    parses it from the same prompt; its result goes back as a tool_result and the next call's
    prompt extends the first's."""
    chat = client.chat.completions.create(model=model, messages=CHAT_FEW_SHOT, tools=CHAT_TOOLS, max_tokens=48,
                                          temperature=0)
    calls = chat.choices[0].message.tool_calls
    assert calls, f"the few-shot prompt no longer makes the model call the tool: {chat.choices[0].message}"
    msg = claude.messages.create(model=model, messages=FEW_SHOT, tools=TOOLS, max_tokens=48, extra_body=GREEDY)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    assert msg.stop_reason == "tool_use" and all(u.id.startswith("toolu_") for u in uses)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    with claude.messages.stream(model=model, messages=FEW_SHOT, tools=TOOLS, max_tokens=48, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    assert streamed.stop_reason == "tool_use"

    history = [*FEW_SHOT, {"role": "assistant", "content": msg.content},    # the client's own blocks
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "9 C, rain"}]}]
    second = claude.messages.create(model=model, messages=history, tools=TOOLS, max_tokens=24, extra_body=GREEDY)
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert total > chat.usage.prompt_tokens + 5 and second.usage.cache_read_input_tokens >= chat.usage.prompt_tokens - 16
    counted = claude.messages.count_tokens(model=model, messages=history, tools=TOOLS)
    assert counted.input_tokens == total


def test_forced_tool_choices(claude: anthropic.Anthropic, model: str) -> None:
    named = claude.messages.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=48, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in named.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str) and named.stop_reason == "tool_use"
    with claude.messages.stream(model=model, messages=QUESTION, tools=TOOLS, max_tokens=48, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        assert [(b.name, b.input) for b in stream.get_final_message().content if b.type == "tool_use"] == [
            (use.name, use.input)]
    anyone = claude.messages.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=64, extra_body=GREEDY,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.name for b in anyone.content if b.type == "tool_use"] == ["get_weather"]
    none = claude.messages.create(model=model, messages=FEW_SHOT, tools=TOOLS, max_tokens=24, extra_body=GREEDY,
                                  tool_choice={"type": "none"})
    assert [b.type for b in none.content] == ["text"]


def test_a_final_assistant_message_is_continued(claude: anthropic.Anthropic, client: openai.OpenAI, model: str) -> None:
    """Anthropic's response prefill: the reply continues the final assistant message (the chat
    endpoint's continue_final_message), and holds only what follows it."""
    start = "The first tip is"
    msg = claude.messages.create(model=model, messages=[*QUESTION, {"role": "assistant", "content": start}],
                                 max_tokens=12, extra_body=GREEDY)
    chat = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                          messages=[*QUESTION, {"role": "assistant", "content": start}],
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    counted = claude.messages.count_tokens(model=model, messages=[*QUESTION, {"role": "assistant", "content": start}])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_count_tokens_is_the_prompt_a_message_runs_on(claude: anthropic.Anthropic, model: str) -> None:
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION)
    msg = claude.messages.create(model=model, system=SYSTEM, messages=QUESTION, max_tokens=1)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_metadata_user_id_names_the_workflow(server: RemoteServer, claude: anthropic.Anthropic, model: str) -> None:
    def counted(*ids: str) -> int:
        return httpx.get(server.url + "/load", params={"pending": ",".join(ids)},
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()["pending_counted"]

    user = f"user_{uuid.uuid4().hex[:8]}_session"
    claude.messages.create(model=model, messages=QUESTION, max_tokens=2, metadata={"user_id": user})
    assert counted(user) == 1
    claude.messages.create(model=model, messages=QUESTION, max_tokens=1, metadata={"user_id": user},
                           extra_body={"is_last_step": True})
    assert counted(user) == 0


@pytest.mark.parametrize("fields,message", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "name"),
    ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": TOOLS}, "get_time"),
    ({"stop_sequences": [""]}, "stop"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config"),
    ({"max_tokens": 5000}, "max_tokens"),
], ids=["no_max_tokens", "image", "server_tool", "tool_without_name", "unknown_tool", "empty_stop", "thinking_kind",
        "output_format", "beyond_context"])
def test_bad_requests_are_anthropic_errors(server: RemoteServer, fields: dict[str, Any], message: str) -> None:
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": QUESTION, "max_tokens": 8, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    resp = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "invalid_request_error"
    assert message in resp.json()["error"]["message"]


def test_errors_through_the_client(server: RemoteServer, claude: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-sonnet", messages=QUESTION, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=model, messages=QUESTION, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=model, messages=[{"role": "robot", "content": "hi"}])
