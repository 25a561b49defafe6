"""Structured outputs through a real server, driven by the official `openai` client: OpenAI's
`response_format` (the client's own `parse()` with a pydantic model included), vLLM's
`structured_outputs` (regex, choice, grammar) on both endpoints, streamed and whole, forced tool
calls (tool_choice "required" and a named function), and bad constraints as 400s.

Token-level correctness (each mask at its position, drafts, chunked prefill) is checked against
transformers in test_model_smollm2.py; here every reply is checked for what a client relies on:
it parses, and it matches its schema, pattern or choice.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server_utils import RemoteServer, wait_until_idle

SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384"]
GREEDY: dict[str, Any] = {"max_tokens": 96, "temperature": 0}
ASK = [{"role": "user", "content": "Describe a fictional software engineer."}]
PERSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "skills"],
                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "additionalProperties": False,
                       "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]
WEATHER = [{"role": "user", "content": "What is the weather in Berlin and what time is it in Tokyo?"}]


class Engineer(pydantic.BaseModel):
    name: str
    age: int
    skills: list[str] = pydantic.Field(max_length=3)   # the small model would list skills until max_tokens


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


def streamed_text(chunks) -> tuple[str, list[str]]:
    text, finish = "", []
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            if c.choices[0].finish_reason:
                finish.append(c.choices[0].finish_reason)
    return text, finish


# --- response_format ----------------------------------------------------------------------------
def test_the_clients_parse_with_a_pydantic_model(client: openai.OpenAI, model: str) -> None:
    """`client.chat.completions.parse(response_format=Model)`: OpenAI's strict json_schema, which
    the client then parses into the model itself."""
    resp = client.chat.completions.parse(model=model, messages=ASK, response_format=Engineer, **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Engineer)
    assert choice.message.parsed == Engineer.model_validate_json(choice.message.content)


def test_json_schema_reply_matches_its_schema_and_streams_the_same(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=model, messages=ASK, response_format=fmt, **GREEDY)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    streamed, finish = streamed_text(client.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, stream=True, **GREEDY))
    assert (streamed, finish) == (text, ["stop"])
    free = client.chat.completions.create(model=model, messages=ASK, **GREEDY).choices[0].message.content
    assert free != text            # the constraint changed the reply


def test_json_object_reply_is_an_object(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a cat as a JSON object with its name and color."}],
        response_format={"type": "json_object"}, **GREEDY)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_response_format_text_is_free_text(client: openai.OpenAI, model: str) -> None:
    a = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "text"}, **GREEDY)
    b = client.chat.completions.create(model=model, messages=ASK, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content


# --- structured_outputs (vLLM's extra_body) -------------------------------------------------------
@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"\(\d{3}\) \d{3}-\d{4}"}, lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
    ({"choice": ["Paris", "Lyon", "Marseille"]}, lambda t: t in ("Paris", "Lyon", "Marseille")),
    ({"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,4}/'},
     lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t)),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),   # GBNF, llama.cpp's format
    ({"json": json.dumps(PERSON_SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), PERSON_SCHEMA) is None),
    ({"json": PERSON_SCHEMA, "disable_any_whitespace": True},
     lambda t: json.dumps(json.loads(t), separators=(",", ":"), ensure_ascii=False) == t),
], ids=["regex", "choice", "lark", "gbnf", "json_text", "json_compact"])
def test_structured_outputs_on_chat(client: openai.OpenAI, model: str, constraint, check) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Then make up a phone number."}]
    resp = client.chat.completions.create(model=model, messages=messages, **GREEDY,
                                          extra_body={"structured_outputs": constraint})
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop" and check(text), text


TAG_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["town"],
              "properties": {"town": {"type": "string"}}}
TAGGED = {"triggers": ["<function="],
          "structures": [{"begin": "<function=get_weather>", "schema": TAG_SCHEMA, "end": "</function>"}]}
FEW_SHOT_CALL = ('Q: What is the weather in Paris?\nA: <function=get_weather>{"city": "Paris"}</function>\n'
                 'Q: What is the weather in Rome?\nA:')


@pytest.mark.parametrize("how", ["response_format", "structured_outputs"])
def test_structural_tags_constrain_only_what_follows_a_trigger(client: openai.OpenAI, model: str, how) -> None:
    """vLLM's structural tags: the reply is free text, but once it writes the trigger the tag's
    begin, JSON of its schema (not the few-shot examples' "city") and its end follow."""
    body = ({"response_format": {"type": "structural_tag", **TAGGED}} if how == "response_format"
            else {"structured_outputs": {"structural_tag": json.dumps(TAGGED)}})
    resp = client.completions.create(model=model, prompt=FEW_SHOT_CALL, max_tokens=40, temperature=0, extra_body=body)
    text = resp.choices[0].text
    segments = re.findall(r"<function=get_weather>(.*?)</function>", text, flags=re.S)
    assert segments, text
    for seg in segments:
        jsonschema.validate(json.loads(seg), TAG_SCHEMA)
    free = client.completions.create(model=model, prompt=FEW_SHOT_CALL, max_tokens=40, temperature=0)
    assert '"city"' in free.choices[0].text      # what the model writes unconstrained


def test_structured_outputs_on_completions_sampled_streamed(client: openai.OpenAI, model: str) -> None:
    """/v1/completions, n=3 sampled with a seed, streamed: every choice is one of the choices, and the
    stream gives what the whole reply gives."""
    choices = ["red", "green", "blue", "yellow"]
    kwargs = dict(model=model, prompt="My favourite colour is", max_tokens=8, n=3, temperature=1.0, seed=7,
                  extra_body={"structured_outputs": {"choice": choices}})
    whole = client.completions.create(**kwargs)
    texts = {c.index: c.text for c in whole.choices}
    assert len(texts) == 3 and all(t in choices for t in texts.values()), texts
    assert all(c.finish_reason == "stop" for c in whole.choices)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts


# --- forced tool calls ----------------------------------------------------------------------------
def test_tool_choice_required_makes_calls_that_match_the_tools(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                          **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert choice.message.content is None
    one = client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, **GREEDY)
    assert len(one.choices[0].message.tool_calls) == 1
    # streamed: the same calls, each in one delta
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                                stream=True, **GREEDY):
        for tc in chunk.choices[0].delta.tool_calls or []:
            acc = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            acc["name"] += tc.function.name or ""
            acc["arguments"] += tc.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_a_named_tool_choice_calls_that_function_and_streams_its_arguments(client: openai.OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model=model, messages=WEATHER, tools=TOOLS, tool_choice=named, **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"              # as OpenAI answers a forced function
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    deltas = [tc for chunk in client.chat.completions.create(
        model=model, messages=WEATHER, tools=TOOLS, tool_choice=named, stream=True, **GREEDY)
        for tc in chunk.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1                             # the arguments arrive in fragments
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments


# --- bad constraints ------------------------------------------------------------------------------
def post(server: RemoteServer, path: str = "/chat/completions", **body: Any) -> httpx.Response:
    if path == "/chat/completions":
        body = {"messages": ASK, "max_tokens": 4, **body}
    else:
        body = {"prompt": "Hi", "max_tokens": 4, **body}
    return httpx.post(server.base_url + path, json=body, timeout=60)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, None),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, None),
    ({"structured_outputs": {"choice": []}}, None),
    ({"structured_outputs": {"json": "{oops"}}, None),
    ({"structured_outputs": {"xml": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": json.dumps({"triggers": ["<f="], "structures": [
        {"begin": "<g=x>", "schema": {}, "end": "</g>"}]})}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="]}}, "response_format"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
], ids=["invalid_schema", "json_schema_without_schema", "unknown_type", "both_fields", "bad_regex",
        "bad_grammar", "two_constraints", "empty_choice", "json_text_not_json", "unknown_key",
        "structural_tag_not_json", "structural_tag_begin_without_trigger", "structural_tag_format_form",
        "structural_tag_without_structures", "removed_guided_json", "removed_guided_choice"])
def test_bad_constraints_are_400(server: RemoteServer, body: dict[str, Any], param) -> None:
    for path in ("/chat/completions", "/completions"):
        resp = post(server, path, **body)
        assert resp.status_code == 400, (path, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        if param is not None:
            assert error["param"] == param, error
    assert post(server).status_code == 200             # and the server is fine
    wait_until_idle(server)                            # nothing leaked: no request, no KV block
