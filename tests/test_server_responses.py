"""OpenAI's Responses API (POST /v1/responses) through a real server, driven by the official
`openai` client: each response is checked against the chat completion it amounts to (same
prompt tokens, same greedy reply, same tool calls), streamed events against the whole response
(the client's own `responses.stream` helper rebuilds it from them), conversation state through
`previous_response_id` (and its KV kept between the calls), the store, and bad requests."""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest
from pydantic import BaseModel

from server_utils import RemoteServer, wait_until_idle

STORE_SIZE = 6
SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--responses-store-size", str(STORE_SIZE)]
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 48}
CHAT_GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
# A worked example, then a new question: the default model follows the example and calls the tool
# (test_server_tools.py checks that on the chat endpoint against the model's raw text).
TOOL_INPUT = [
    {"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
    {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"role": "user", "content": "What is the weather in Berlin?"},
]
TOOL_MESSAGES = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "What is the weather in Berlin?"},
]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


def chat_equivalent(client: openai.OpenAI, model: str, messages: list[dict], **fields: Any):
    return client.chat.completions.create(model=model, messages=messages, **CHAT_GREEDY, **fields)


def test_a_text_response_is_the_chat_completion_it_amounts_to(client: openai.OpenAI, model: str) -> None:
    resp = client.responses.create(model=model, instructions="Answer briefly.",
                                   input="What is the capital of France?", **GREEDY)
    chat = chat_equivalent(client, model, [{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "What is the capital of France?"}])
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == model
    assert resp.output_text == chat.choices[0].message.content and resp.output_text
    assert [item.type for item in resp.output] == ["message"]
    message = resp.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    finished = chat.choices[0].finish_reason
    assert resp.status == ("incomplete" if finished == "length" else "completed")
    assert message.status == resp.status
    if resp.status == "incomplete":
        assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and chat.usage is not None
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "Answer briefly." and resp.max_output_tokens == 48 and resp.temperature == 0


def test_streamed_events_rebuild_the_response(client: openai.OpenAI, model: str) -> None:
    question = "What is the capital of France? Answer in one word."
    whole = client.responses.create(model=model, input=question, store=False, **GREEDY)
    assert whole.status == "completed", "the reply should end before max_output_tokens"
    with client.responses.stream(model=model, input=question, store=False, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 1
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.id != whole.id and final.status == whole.status
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_conversation_with_its_kv(client: openai.OpenAI, model: str) -> None:
    block = 16   # `sluice serve`'s default --block-size
    system = "You are a careful assistant. " + " ".join(f"Item {i} is a box." for i in range(40))
    first = client.responses.create(model=model, instructions=system,
                                     input="Describe the boxes above in a few sentences.",
                                     temperature=0, max_output_tokens=48)
    second = client.responses.create(model=model, instructions=system, previous_response_id=first.id,
                                     input="[search result] " + " ".join(["the file was found"] * 10),
                                     temperature=0, max_output_tokens=8)
    assert second.previous_response_id == first.id
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": system},
        {"role": "user", "content": "Describe the boxes above in a few sentences."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "[search result] " + " ".join(["the file was found"] * 10)},
    ])
    assert second.usage is not None and chat.usage is not None and first.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    # The chain is one workflow: the first call's KV, its reply included, was retained for the
    # second, down to its partly filled last block (a prefix cache alone stops at the last full
    # block); only the reply's last token, sampled and never fed back, has no KV.
    computed = first.usage.input_tokens + first.usage.output_tokens - 1
    assert computed % block, "pick lengths where a partly filled block tells retention from the prefix cache"
    assert second.usage.input_tokens_details.cached_tokens == computed


def test_a_session_id_names_the_workflow_instead_of_the_chain(server: RemoteServer, client: openai.OpenAI,
                                                              model: str) -> None:
    """vLLM's `session_id` names the workflow of a response, as `workflow_id` does; without either
    the chain of responses is the workflow, named by its first response's id."""
    def counted(*ids: str) -> int:
        return httpx.get(server.url + "/load", params={"pending": ",".join(ids)}, timeout=10).json()["pending_counted"]

    chained = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    named = client.responses.create(model=model, input="Hi", max_output_tokens=2, extra_body={"session_id": "sess-r"})
    assert counted(chained.id) == 1 and counted("sess-r") == 1 and counted(named.id) == 0
    keyed = client.responses.create(model=model, input="Hi", max_output_tokens=2, prompt_cache_key="conv-r")
    assert counted("conv-r") == 1 and counted(keyed.id) == 0    # an explicit key beats the chain
    for body in ({"session_id": "sess-r"}, {"workflow_id": chained.id}, {"prompt_cache_key": "conv-r"}):
        client.responses.create(model=model, input="Bye", max_output_tokens=1, store=False,
                                extra_body={**body, "is_last_step": True})
    assert counted(chained.id, "sess-r", "conv-r") == 0


def test_function_calls_and_their_outputs_as_items(client: openai.OpenAI, model: str) -> None:
    chat = chat_equivalent(client, model, TOOL_MESSAGES, tools=CHAT_TOOLS)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls or []]
    assert expected, "the few-shot prompt no longer makes the model call the tool"
    resp = client.responses.create(model=model, input=TOOL_INPUT, tools=TOOLS, **GREEDY)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed" for c in calls)
    assert resp.usage is not None and resp.usage.input_tokens == chat.usage.prompt_tokens
    # streamed: one item per call, its arguments in deltas
    with client.responses.stream(model=model, input=TOOL_INPUT, tools=TOOLS, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == expected
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(c.arguments for c in streamed)
    # the agent's next turn: the call's output as an item, after the response that made the call
    follow = client.responses.create(model=model, previous_response_id=resp.id, tools=TOOLS, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Rain, 12 C"}], **GREEDY)
    chat_follow = chat_equivalent(client, model, TOOL_MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Rain, 12 C"}], tools=CHAT_TOOLS, tool_choice="none")
    assert follow.usage is not None and follow.usage.input_tokens == chat_follow.usage.prompt_tokens
    assert follow.output_text == chat_follow.choices[0].message.content


def test_a_named_function_is_forced_and_streams_its_arguments(client: openai.OpenAI, model: str) -> None:
    forced = {"type": "function", "name": "get_weather"}
    resp = client.responses.create(model=model, input="Tell me a joke.", tools=TOOLS, tool_choice=forced,
                                   temperature=0, max_output_tokens=64)
    assert [item.type for item in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    with client.responses.stream(model=model, input="Tell me a joke.", tools=TOOLS, tool_choice=forced,
                                 temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments


class City(BaseModel):
    name: str
    country: str


def test_text_format_json_schema_parses(client: openai.OpenAI, model: str) -> None:
    resp = client.responses.parse(model=model, input="Name a city in Italy.", text_format=City,
                                  temperature=0, max_output_tokens=64)
    assert isinstance(resp.output_parsed, City) and resp.output_parsed.name
    # json_object: the reply is held to JSON from its first token (the model, free, greets back);
    # whether it closes the object within max_output_tokens is the model's business
    free = client.responses.create(model=model, input="Hi!", temperature=0, max_output_tokens=8)
    obj = client.responses.create(model=model, input="Hi!", text={"format": {"type": "json_object"}},
                                  temperature=0, max_output_tokens=8)
    assert not free.output_text.lstrip().startswith("{") and obj.output_text.lstrip().startswith("{")
    assert obj.text is not None and obj.text.format.type == "json_object"


def test_the_store_retrieve_delete_and_eviction(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="Hi", max_output_tokens=2)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Hi", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    ids = [client.responses.create(model=model, input=f"Hi {i}", max_output_tokens=1).id
           for i in range(STORE_SIZE + 1)]
    with pytest.raises(openai.NotFoundError):   # the least recently used went first
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_input_items_list_the_conversation_a_response_was_made_from(server: RemoteServer, client: openai.OpenAI,
                                                                   model: str) -> None:
    first = client.responses.create(model=model, instructions="Answer briefly.", input=TOOL_INPUT, tools=TOOLS,
                                    **GREEDY)
    listed = client.responses.input_items.list(first.id, order="asc")
    assert [item.type for item in listed.data] == ["message", "function_call", "message"]
    assert listed.data[0].content[0].text == "What is the weather in Paris?" and listed.data[0].role == "user"
    assert listed.data[1].call_id == "call_0" and listed.data[1].arguments == '{"city": "Paris"}'
    assert listed.data[2].content[0].text == "What is the weather in Berlin?"
    # A chained response was made from the whole conversation: the first one's input and output
    # (their ids as the first response gave them), then its own input.
    second = client.responses.create(model=model, previous_response_id=first.id, input="Thanks!",
                                     max_output_tokens=2)
    chain = list(client.responses.input_items.list(second.id, order="asc", limit=2))  # the client pages
    assert [item.id for item in chain[:3]] == [item.id for item in listed.data]
    assert [item.id for item in chain[3:-1]] == [item.id for item in first.output]
    assert chain[-1].type == "message" and chain[-1].content[0].text == "Thanks!"
    newest = client.responses.input_items.list(second.id, limit=1)        # newest first by default
    assert [item.id for item in newest.data] == [chain[-1].id] and newest.has_more
    for query, param in (({"limit": 0}, "limit"), ({"order": "sideways"}, "order"), ({"after": "msg_x"}, "after"),
                         ({"limit": "many"}, "limit")):
        resp = httpx.get(f"{server.base_url}/responses/{second.id}/input_items", params=query, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


BAD = {
    "background": ({"background": True}, "background"),
    "include": ({"include": ["message.output_text.logprobs"]}, "include"),
    "truncation_auto": ({"truncation": "auto"}, "truncation"),
    "reasoning_effort": ({"reasoning": {"effort": "high"}}, "reasoning"),
    "max_output_tokens_zero": ({"max_output_tokens": 0}, "max_output_tokens"),
    "input_empty": ({"input": []}, "input"),
    "input_wrong_type": ({"input": 5}, "input"),
    "input_image_part": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input"),
    "input_unknown_item": ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    "input_unknown_role": ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    "function_call_without_call_id": ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
                                      "input"),
    "hosted_tool": ({"tools": [{"type": "web_search"}]}, "tools"),
    "named_function_not_among_tools": ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}},
                                       "tool_choice"),
    "json_schema_without_schema": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    "bad_json_schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
                        "text"),
    "input_beyond_context": ({"input": "word " * 2100}, "input"),
    "unknown_previous_response": ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    "other_model": ({"model": "other"}, "model"),
    "prompt_logprobs": ({"prompt_logprobs": 1}, "prompt_logprobs"),
}


@pytest.mark.parametrize("fields,param", BAD.values(), ids=BAD.keys())
def test_bad_responses_requests_are_4xx(server: RemoteServer, fields: dict[str, Any], param: str) -> None:
    body = {"input": "Hi", "max_output_tokens": 4, **fields}
    resp = httpx.post(server.base_url + "/responses", json=body, timeout=60)
    status = 404 if param in ("previous_response_id", "model") else 400
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_nothing_is_left_running(server: RemoteServer) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_until_idle(server, timeout=30)
