"""A thinking model's reasoning and GLM's tool-call format through a real server
(`--reasoning-parser glm47 --enable-auto-tool-choice --tool-call-parser glm47`), driven by the
official openai and anthropic clients. The default model does not think or speak GLM's format by
itself; few-shot histories make its greedy replies do both, and every check compares the parsed
reply with the raw reply text of the same prompt (from /v1/completions, which parses nothing)."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from server_utils import RemoteServer
from sluice.server.tool_calls import ToolCallStream, glm_call_parser, reply_parts

SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384", "--enable-auto-tool-choice",
               "--tool-call-parser", "glm47", "--reasoning-parser", "glm47"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
TOOL_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "user", "content": "What is the weather in Berlin?"},
]
THINK_SHOT = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>Two plus two makes four.</think>The answer is 4."},
    {"role": "user", "content": "What is 3 plus 3?"},
    {"role": "assistant", "content": "<think>Three plus three makes six.</think>The answer is 6."},
    {"role": "user", "content": "What is 5 plus 5?"},
]
GREEDY: dict[str, Any] = {"max_tokens": 120, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


def raw_reply(server: RemoteServer, model: str, messages: list[dict[str, Any]], **chat: Any) -> str:
    """The unparsed greedy reply to the chat's prompt: /tokenize renders it, /v1/completions runs it."""
    ids = httpx.post(server.url + "/tokenize", json={"model": model, "messages": messages, **chat}).json()["tokens"]
    body = {"model": model, "prompt": ids, **GREEDY}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def thought(server: RemoteServer, model: str) -> tuple[str, str]:
    """(reasoning, content) of the few-shot reply, split by hand from its raw text."""
    text = raw_reply(server, model, THINK_SHOT)
    assert text.startswith("<think>") and "</think>" in text, f"the few-shot prompt no longer makes the model think: {text!r}"
    reasoning, _, content = text[len("<think>"):].partition("</think>")
    return reasoning, content


def test_reasoning_comes_back_apart_from_the_content(client: openai.OpenAI, model: str, thought) -> None:
    reasoning, content = thought
    message = client.chat.completions.create(model=model, messages=THINK_SHOT, **GREEDY).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (reasoning, content)
    chunks = list(client.chat.completions.create(model=model, messages=THINK_SHOT, stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert not any(d.content and d.model_extra.get("reasoning") for d in deltas)
    hidden = client.chat.completions.create(model=model, messages=THINK_SHOT, extra_body={"include_reasoning": False},
                                            **GREEDY).choices[0].message
    assert hidden.content == content and "reasoning" not in hidden.model_extra
    plain = client.chat.completions.create(model=model, messages=THINK_SHOT[:1], max_tokens=8, temperature=0)
    assert "reasoning" not in plain.choices[0].message.model_extra      # no thought, no field
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=THINK_SHOT, extra_body={"reasoning_effort": "huge"}, **GREEDY)
    ok = client.chat.completions.create(model=model, messages=THINK_SHOT, reasoning_effort="low", **GREEDY)
    assert ok.choices[0].message.content == content      # this model's template has no such variable


def test_responses_reasoning_items(client: openai.OpenAI, model: str, thought) -> None:
    reasoning, content = thought
    resp = client.responses.create(model=model, input=THINK_SHOT, max_output_tokens=GREEDY["max_tokens"], temperature=0,
                                   reasoning={"effort": "low"})
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == reasoning and resp.output_text == content
    assert resp.reasoning.effort == "low"
    events = list(client.responses.create(model=model, input=THINK_SHOT, max_output_tokens=GREEDY["max_tokens"],
                                          temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [reasoning]
    # the chain: the reply's reasoning item is part of the stored conversation, and an input
    # that sends a reasoning item back is accepted
    follow = client.responses.create(model=model, previous_response_id=resp.id, input="And 6 plus 6?",
                                     max_output_tokens=16, temperature=0)
    assert follow.status in ("completed", "incomplete")
    items = client.responses.input_items.list(follow.id, order="asc").data
    assert [i.type for i in items][-3:] == ["reasoning", "message", "message"]
    again = client.responses.create(model=model, input=THINK_SHOT + [resp.output[0].model_dump(exclude_none=True),
                                                                     resp.output[1].model_dump(exclude_none=True),
                                                                     {"role": "user", "content": "And 6 plus 6?"}],
                                    max_output_tokens=16, temperature=0)
    assert again.status in ("completed", "incomplete")


def test_messages_thinking_blocks(server: RemoteServer, model: str, thought) -> None:
    reasoning, content = thought
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model=model, max_tokens=GREEDY["max_tokens"], messages=THINK_SHOT, extra_body={"temperature": 0})
    msg = client.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", reasoning), ("text", content)]
    assert msg.content[0].signature
    with client.messages.stream(**kw) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "signature_delta" in kinds and kinds[-1] == "text_delta"
    assert [b.type for b in final.content] == ["thinking", "text"]        # one block per part, however streamed
    assert final.content[0].thinking == reasoning and final.content[1].text == content
    off = client.messages.create(**kw, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == content
    # a reply's thinking sent back in the history is accepted
    history = THINK_SHOT + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                            {"role": "user", "content": "And 6 plus 6?"}]
    assert client.messages.create(model=model, max_tokens=8, messages=history).content


def test_structured_outputs_start_after_a_thought_the_prompt_opens(server: RemoteServer, client: openai.OpenAI,
                                                                   model: str) -> None:
    """A reply whose prompt opens a thought (here a prefill: the final assistant message is
    `<think>`, continued) thinks freely, then its answer obeys the constraint: the raw reply
    (/v1/completions with the same constraint) is thought, `</think>`, answer, and chat (whole
    and streamed) and Messages (a prefill too) parse it into reasoning and content, one thinking
    block. A prompt that opens no thought is constrained from its first token: all content."""
    opened = THINK_SHOT + [{"role": "assistant", "content": "<think>"}]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    regex = {"structured_outputs": {"regex": r"The answer is \d+\."}}
    ids = httpx.post(server.url + "/tokenize", json={"model": model, "messages": opened, **prefill}).json()["tokens"]
    raw = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, **regex, **GREEDY}).json()["choices"][0]
    thought, tag, answer = raw["text"].partition("</think>")
    assert tag and thought and re.fullmatch(r"The answer is \d+\.", answer) and raw["finish_reason"] == "stop", raw
    m = client.chat.completions.create(model=model, messages=opened, extra_body={**prefill, **regex},
                                       **GREEDY).choices[0].message
    assert (m.model_extra["reasoning"], m.content) == (thought, answer)
    chunks = list(client.chat.completions.create(model=model, messages=opened, stream=True,
                                                 extra_body={**prefill, **regex}, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    js = client.chat.completions.create(model=model, messages=opened, extra_body=prefill, **GREEDY, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0].message
    assert js.model_extra["reasoning"] and json.loads(js.content).keys() == {"answer"}
    anth = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = anth.messages.create(model=model, max_tokens=GREEDY["max_tokens"], messages=opened,
                               extra_body={"temperature": 0, "output_config": {"format": {
                                   "type": "json_schema", "schema": schema}}})
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    assert msg.content[0].thinking == js.model_extra["reasoning"]
    assert json.loads(msg.content[1].text) == json.loads(js.content)
    plain = client.chat.completions.create(model=model, messages=THINK_SHOT, extra_body=regex, **GREEDY).choices[0].message
    assert "reasoning" not in plain.model_extra and re.fullmatch(r"The answer is \d+\.", plain.content)
    # a prompt whose text ends with the tag but whose tokens do not hold it ("?<" is one token here):
    # the engine constrains from the first token, and the reply is read the same way, as content
    merged = THINK_SHOT + [{"role": "assistant", "content": "Hmm?<think>"}]
    m = client.chat.completions.create(model=model, messages=merged, extra_body={**prefill, **regex},
                                       **GREEDY).choices[0].message
    assert "reasoning" not in m.model_extra and re.fullmatch(r"The answer is \d+\.", m.content), m


@pytest.fixture(scope="module")
def glm_raw(server: RemoteServer, model: str) -> str:
    text = raw_reply(server, model, TOOL_SHOT, tools=TOOLS)
    assert "<arg_key>city</arg_key>" in text, f"the few-shot prompt no longer makes a GLM-format call: {text!r}"
    return text


def calls_of(message) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_glm_tool_calls(client: openai.OpenAI, model: str, glm_raw: str) -> None:
    """The calls the model writes in GLM's format come back as tool_calls (values typed by the
    tool's schema), whole and streamed."""
    stream = ToolCallStream(glm_call_parser(TOOLS))
    content, expected, _ = reply_parts(stream.feed(glm_raw) + stream.finish())
    assert expected and expected[0].name == "get_weather"
    whole = client.chat.completions.create(model=model, messages=TOOL_SHOT, tools=TOOLS, **GREEDY)
    assert calls_of(whole.choices[0].message) == [(c.name, json.loads(c.arguments)) for c in expected]
    assert whole.choices[0].message.content == content
    assert whole.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model=model, messages=TOOL_SHOT, tools=TOOLS, stream=True, **GREEDY))
    streamed = [(tc.function.name, json.loads(tc.function.arguments)) for c in chunks if c.choices
                for tc in c.choices[0].delta.tool_calls or []]
    assert streamed == calls_of(whole.choices[0].message)
    none = client.chat.completions.create(model=model, messages=TOOL_SHOT, tools=TOOLS, tool_choice="none", **GREEDY)
    assert none.choices[0].message.content == glm_raw and not none.choices[0].message.tool_calls


def test_unknown_parsers_and_bad_reasoning_configs_are_a_startup_error() -> None:
    import subprocess
    import sys

    for flag in ("--reasoning-parser", "--tool-call-parser"):
        proc = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", flag, "nope"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "invalid choice" in proc.stderr
    # --reasoning-config: JSON, vLLM's keys, and both tags without a reasoning parser
    for value, message in (("{", "not JSON"), ('{"reasoning_end_str": "</r>"}', "needs both"),
                           ('{"end": "</r>"}', "unknown reasoning config keys")):
        proc = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", "--reasoning-config", value],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_prompt_text_and_documents(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """vLLM's `return_prompt_text` (the prompt the model ran on: what /tokenize renders, whole and
    in the first streamed chunk) and `documents` reaching the template (this one ignores them, so
    the prompt is unchanged; tests/test_server.py checks template variables reach a template)."""
    ids = httpx.post(server.url + "/tokenize", json={"model": model, "messages": THINK_SHOT}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]
    whole = client.chat.completions.create(model=model, messages=THINK_SHOT, max_tokens=2, temperature=0,
                                           extra_body={"return_prompt_text": True})
    assert whole.model_extra["prompt_text"] == text and text.endswith("<|im_start|>assistant\n")
    chunks = list(client.chat.completions.create(model=model, messages=THINK_SHOT, max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"return_prompt_text": True}))
    assert chunks[0].model_extra["prompt_text"] == text
    assert all("prompt_text" not in c.model_extra for c in chunks[1:])
    plain = client.chat.completions.create(model=model, messages=THINK_SHOT, max_tokens=2, temperature=0)
    assert "prompt_text" not in plain.model_extra
    docs = client.chat.completions.create(model=model, messages=THINK_SHOT, max_tokens=2, temperature=0,
                                          extra_body={"documents": [{"title": "t", "text": "x"}]})
    assert docs.usage.prompt_tokens == plain.usage.prompt_tokens


def test_thinking_token_budget(server: RemoteServer, client: openai.OpenAI, model: str, thought) -> None:
    """vLLM's `thinking_token_budget` (and Anthropic's `budget_tokens`, which maps to it) cuts the
    thought: the raw reply (/v1/completions) of a budget of 3 is the model's thought cut there with
    `</think>` written, and every API parses that same reply; -1 is no bound."""
    reasoning, content = thought
    ids = httpx.post(server.url + "/tokenize", json={"model": model, "messages": THINK_SHOT}).json()["tokens"]
    raw = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "thinking_token_budget": 3, **GREEDY}).json()["choices"][0]["text"]
    assert raw.startswith("<think>") and "</think>" in raw, raw
    cut, _, after = raw[len("<think>"):].partition("</think>")
    assert reasoning.startswith(cut) and 0 < len(cut) < len(reasoning), (cut, reasoning)
    head = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": cut, "add_special_tokens": False})
    assert head.json()["count"] == 3
    chat = client.chat.completions.create(model=model, messages=THINK_SHOT, extra_body={"thinking_token_budget": 3},
                                          **GREEDY).choices[0].message
    assert (chat.model_extra["reasoning"], chat.content) == (cut, after)
    unbounded = client.chat.completions.create(model=model, messages=THINK_SHOT, extra_body={"thinking_token_budget": -1},
                                               **GREEDY).choices[0].message
    assert (unbounded.model_extra["reasoning"], unbounded.content) == (reasoning, content)
    resp = client.responses.create(model=model, input=THINK_SHOT, max_output_tokens=GREEDY["max_tokens"], temperature=0,
                                   extra_body={"thinking_token_budget": 3})
    assert (resp.output[0].content[0].text, resp.output_text) == (cut, after)
    anth = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = anth.messages.create(model=model, max_tokens=GREEDY["max_tokens"], messages=THINK_SHOT,
                               thinking={"type": "enabled", "budget_tokens": 3}, extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", cut), ("text", after)]
    with pytest.raises(anthropic.BadRequestError):
        anth.messages.create(model=model, max_tokens=8, messages=THINK_SHOT,
                             thinking={"type": "enabled", "budget_tokens": -3})
