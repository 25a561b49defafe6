"""Tool calling for /v1/chat/completions: putting the tools in the prompt, and parsing the calls
out of the model's text (`--enable-auto-tool-choice --tool-call-parser hermes`, vLLM's flags).

The "hermes" format (Hermes 2 Pro, Qwen 2.5 and later, and many fine-tunes): the model answers a
call as a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`,
one such block per call, possibly after some text. Everything outside the blocks is the message's
content.

Prompting: a chat template that knows about tools (it reads `tools`, and renders assistant
`tool_calls`) is given them as they are. A template that does not (SmolLM2's plain ChatML, for
one) would silently drop them, so sluice then writes the same format into the messages itself:
the tool signatures and the calling convention into the system message, an assistant message's
`tool_calls` as `<tool_call>` blocks after its content, and a tool result between
`<tool_response>` tags.

Streaming: text is held back only while it could be the start of a `<tool_call>` tag; each call
is sent as one delta (id, name and the whole arguments string) once its block is closed, which
the OpenAI client accumulates like any other split.

Forced calls (`tool_choice` "required" or a named function, as vLLM does them): the reply is
constrained by structured outputs to a JSON schema, so it is a call whatever the model would have
said. A named function's reply is its arguments (an object of the function's `parameters`
schema), streamed as argument fragments. "required" constrains the reply to a JSON array of
`{"name": ..., "parameters": {...}}` objects, one of the tools each (at most one without
`parallel_tool_calls`); each call is sent (one delta) as soon as its element of the array closes.

The "glm45" / "glm47" format (GLM-4.5, 4.6, 4.7 and GLM-5.x; vLLM's parser names): a call is
`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>` (whitespace
or newlines may separate the parts; a call may have no arguments). Values are text; each is
typed by its parameter's schema in the request's tools (null, integer, number, boolean, object,
array, string, first that fits), a value of a parameter without one stays a string. A block that
names no tool of the request, or holds anything besides its name and argument pairs, stays text.

The "qwen3_coder" / "qwen3_xml" format (Qwen3-Coder and later Qwen models; vLLM's names):
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...</function>\n</tool_call>`,
each value typed as GLM's are, without the newline on each side of it.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sluice.server.reasoning import ReasoningDelta, split_held

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# --tool-call-parser -> format
CALL_FORMATS = {"hermes": "hermes", "glm45": "glm", "glm47": "glm", "qwen3_coder": "qwen_xml", "qwen3_xml": "qwen_xml"}


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str      # a JSON object, as OpenAI sends it


def parse_call_body(body: str) -> Optional[ParsedToolCall]:
    """One block's JSON, or None when it is not a call (not JSON, no string `name`, arguments
    neither an object nor a JSON string of one)."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[Optional[str], list[ParsedToolCall]]:
    """A whole reply: its content (None when only calls) and its calls, in order. A block that
    does not parse stays in the content as written; an unclosed last block is parsed up to the end
    of the text (a model that stopped at its end-of-turn token without the closing tag)."""
    stream = ToolCallStream()
    content, calls, _ = reply_parts(stream.feed(text) + stream.finish())
    return content, calls


def reply_parts(events: list[Any]) -> tuple[Optional[str], list[ParsedToolCall], bool]:
    """A whole reply's parser events as (content, calls, whether calls were parsed from text): a
    named function's argument fragments make one call; content is None when there are only calls."""
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e for e in events if isinstance(e, ParsedToolCall)]
    fragments = [e for e in events if isinstance(e, ArgumentsDelta)]
    parsed = bool(calls)
    if fragments:
        calls.append(ParsedToolCall(fragments[0].name, "".join(f.text for f in fragments)))
    if calls and not content.strip():
        return None, calls, parsed
    return content, calls, parsed


def sample_events(parser: Optional[Any], sample: Any) -> list[Any]:
    """The events a sample's new text makes (the parser's, or the text itself without one), and
    once the sample is done (not failed), what the parser still held."""
    if parser is None:
        return [sample.text_delta] if sample.text_delta else []
    events = parser.feed(sample.text_delta) if sample.text_delta else []
    if sample.finish_reason and sample.finish_reason != "error":
        events += parser.finish()
    return events


# --- the GLM format ----------------------------------------------------------------------------------

_GLM_ARG_KEY = "<arg_key>"
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_TYPE_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows: `type` (a name or a list), the types of its
    `enum` values, and those of `anyOf` / `oneOf` / `allOf` branches; {"string"} when it says none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for t in ([kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []):
        if isinstance(t, str):
            types.add(t)
    for value in schema.get("enum") or []:
        types.add("null" if value is None else "boolean" if isinstance(value, bool) else
                  "integer" if isinstance(value, int) else "number" if isinstance(value, float) else
                  "string" if isinstance(value, str) else "object" if isinstance(value, dict) else "array")
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or []:
            if _says_type(branch):          # a branch that says nothing adds no type
                types |= schema_types(branch)
    return types or {"string"}


def _says_type(schema: Any) -> bool:
    return isinstance(schema, dict) and any(k in schema for k in ("type", "enum", "anyOf", "oneOf", "allOf"))


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def typed_value(text: str, types: set[str]) -> Any:
    """An argument's text as the first of `types` (in _TYPE_ORDER) it reads as; a type the order
    does not know is read as any JSON; the text itself where nothing fits."""
    for kind in _TYPE_ORDER:
        if kind not in types:
            continue
        if kind == "string":
            return text
        t = text.strip()
        if kind == "null" and t.lower() == "null":
            return None
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", t):
            return int(t)
        if kind == "number":
            try:
                x = float(t)
            except ValueError:
                continue
            if math.isfinite(x):
                return int(x) if x.is_integer() and "." not in t and "e" not in t.lower() else x
        if kind == "boolean" and t.lower() in ("true", "false"):
            return t.lower() == "true"
        if kind in ("object", "array"):
            try:
                v = json.loads(t)
            except (json.JSONDecodeError, RecursionError):
                continue
            if isinstance(v, dict if kind == "object" else list) and _finite(v):
                return v
    if not types & set(_TYPE_ORDER):
        try:
            v = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text
        return v if _finite(v) else text
    return text


def _tool_properties(tools: Optional[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each function tool's name -> its parameters' schemas (`properties`)."""
    properties: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        if isinstance(fn.get("name"), str):
            props = (fn.get("parameters") or {}).get("properties")
            properties[fn["name"]] = props if isinstance(props, dict) else {}
    return properties


def _pairs_call(name: str, text: str, pair: re.Pattern, properties: dict[str, dict[str, Any]],
                value: Callable[[str], str] = lambda v: v) -> Optional[ParsedToolCall]:
    """A call of `name` whose arguments are `text`: key/value matches of `pair` (groups 1, 2) and
    whitespace only; each value (after `value`) typed by its parameter's schema."""
    if name not in properties:
        return None
    args: dict[str, Any] = {}
    pos = 0
    while text[pos:].strip():
        m = pair.match(text, pos)
        if m is None:
            return None
        key, raw = m.group(1).strip(), value(m.group(2))
        schema = properties[name].get(key)
        args[key] = typed_value(raw, schema_types(schema)) if schema is not None else raw
        pos = m.end()
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


def glm_call_parser(tools: Optional[list[dict[str, Any]]]) -> Callable[[str], Optional[ParsedToolCall]]:
    """The body of a GLM `<tool_call>` block as a call of one of `tools` (OpenAI's function tool
    dicts), or None when it is not one."""
    properties = _tool_properties(tools)

    def parse(body: str) -> Optional[ParsedToolCall]:
        start = body.find(_GLM_ARG_KEY)
        if start < 0:
            return _pairs_call(body.strip(), "", _GLM_PAIR, properties)
        return _pairs_call(body[:start].strip(), body[start:], _GLM_PAIR, properties)

    return parse


_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _unwrap_newlines(value: str) -> str:
    """A Qwen XML value without the one newline the format puts on each side of it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def qwen_xml_call_parser(tools: Optional[list[dict[str, Any]]]) -> Callable[[str], Optional[ParsedToolCall]]:
    """The body of a Qwen3-Coder `<tool_call>` block (`<function=NAME>` with `<parameter=KEY>`
    values, each between newlines) as a call of one of `tools`, or None when it is not one."""
    properties = _tool_properties(tools)

    def parse(body: str) -> Optional[ParsedToolCall]:
        m = _QWEN_FUNCTION.fullmatch(body)
        if m is None:
            return None
        return _pairs_call(m.group(1).strip(), m.group(2), _QWEN_PARAMETER, properties, _unwrap_newlines)

    return parse


_BODY_PARSERS = {"glm": glm_call_parser, "qwen_xml": qwen_xml_call_parser}


def call_parser_factory(parser_name: str, tools: Optional[list[dict[str, Any]]]) -> Callable[[], "ToolCallStream"]:
    """Per-choice stream parsers for `--tool-call-parser parser_name` and a request's tools."""
    fmt = CALL_FORMATS[parser_name]
    if fmt in _BODY_PARSERS:
        parse = _BODY_PARSERS[fmt](tools)
        return lambda: ToolCallStream(parse)
    return ToolCallStream


class ToolCallStream:
    """Incremental parsing of `<tool_call>` blocks: `feed(delta)` and at the end `finish()` each
    return the events that are certain so far, in order: content strings and `ParsedToolCall`s.
    Concatenating the events of any split of a text gives what the whole text gives. A block's
    body is read by `parse_body` (hermes JSON by default; `glm_call_parser` for GLM's format)."""

    def __init__(self, parse_body: Optional[Callable[[str], Optional[ParsedToolCall]]] = None) -> None:
        self._parse = parse_body or (lambda body: parse_call_body(body.strip()))
        self._pending = ""          # text not yet emitted
        self._in_call = False       # inside a <tool_call> block (its opening tag consumed)

    def feed(self, delta: str) -> list[Any]:
        self._pending += delta
        events: list[Any] = []
        while True:
            if self._in_call:
                end = self._pending.find(TOOL_CALL_END)
                if end < 0:
                    return events
                body = self._pending[:end]
                self._pending = self._pending[end + len(TOOL_CALL_END):]
                self._in_call = False
                call = self._parse(body)
                events.append(call if call is not None else TOOL_CALL_START + body + TOOL_CALL_END)
                continue
            start = self._pending.find(TOOL_CALL_START)
            if start >= 0:
                if start:
                    events.append(self._pending[:start])
                self._pending = self._pending[start + len(TOOL_CALL_START):]
                self._in_call = True
                continue
            certain, self._pending = split_held(self._pending, (TOOL_CALL_START,))
            return events + [certain] if certain else events

    def finish(self) -> list[Any]:
        pending, self._pending = self._pending, ""
        if not self._in_call:
            return [pending] if pending else []
        self._in_call = False
        call = self._parse(pending)
        return [call] if call is not None else [TOOL_CALL_START + pending]


# --- forced calls (tool_choice "required" or a named function) --------------------------------------

def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if params else {"type": "object", "properties": {}}


def named_call_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The schema of the named function's arguments; ValueError if no tool has that name."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return _parameters(tool["function"])
    raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls (at most one unless `parallel`), each one of the tools."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": _parameters(t["function"])}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _required_call(element: str) -> Optional[ParsedToolCall]:
    """One element of a "required" reply's array, or None if it is not a call."""
    try:
        item = json.loads(element)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("parameters", {})
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(item["name"], json.dumps(args, ensure_ascii=False))


def parse_required_calls(text: str) -> Optional[list[ParsedToolCall]]:
    """The calls of a "required" reply (those complete, if it was cut short), or None if none is."""
    stream = RequiredCallsStream()
    calls = [e for e in stream.feed(text) if isinstance(e, ParsedToolCall)]
    return calls or None


@dataclass
class ArgumentsDelta:
    """A fragment of a named function's arguments, as it is generated."""

    name: str
    text: str


class NamedCallStream:
    """A named tool_choice's reply: all of it is the one call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def feed(self, delta: str) -> list[Any]:
        return [ArgumentsDelta(self.name, delta)] if delta else []

    def finish(self) -> list[Any]:
        return []


class RequiredCallsStream:
    """A "required" reply, a JSON array of calls: each call is emitted as soon as its element of
    the array closes (a scan of strings and nesting; the grammar guarantees the JSON is well
    formed). If no call came out at all (a reply cut short inside the first one), its text is the
    content."""

    def __init__(self) -> None:
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element_start: Optional[int] = None
        self._calls = 0

    def feed(self, delta: str) -> list[Any]:
        self._text += delta
        events: list[Any] = []
        for i in range(self._scanned, len(self._text)):
            ch = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                if self._depth == 1 and ch == "{":
                    self._element_start = i
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._element_start is not None:
                    call = _required_call(self._text[self._element_start:i + 1])
                    self._element_start = None
                    if call is not None:
                        self._calls += 1
                        events.append(call)
        self._scanned = len(self._text)
        return events

    def finish(self) -> list[Any]:
        return [self._text] if not self._calls and self._text else []


# --- prompting ------------------------------------------------------------------------------------

class ReplyParts:
    """The parts of one reply (reasoning, text and tool calls), built from a parser's events
    (`ReasoningDelta`s, text strings, whole `ParsedToolCall`s, a named call's `ArgumentsDelta`s)
    as they come; `add` and `finish` return the stream events each causes. Whitespace-only text is
    held until more text comes, so a reply that only calls tools has no empty text part; calls past
    `max_calls` are dropped.

    An API's shapes come from a subclass: `REASONING`, `TEXT` and `CALL` (the `type` of its parts),
    `_open_reasoning()`, `_reasoning(text)`, `_open_text()`, `_text(text)`, `_open_call(name)`,
    `_arguments(text)` and `_close(status)`, each returning stream events; `_open_part(part)` opens
    a part after closing the open one."""

    REASONING = "reasoning"
    TEXT = "text"
    CALL = "call"

    def __init__(self, max_calls: Optional[int]) -> None:
        self.parts: list[dict[str, Any]] = []
        self._open: Optional[dict[str, Any]] = None     # the part being generated
        self._blank = ""                                 # held whitespace
        self._max_calls = max_calls
        self.calls = 0

    def add(self, event: Any) -> list[Any]:
        if isinstance(event, ReasoningDelta):
            opened = self._open_type() == self.REASONING
            return ([] if opened else self._open_reasoning()) + self._reasoning(event.text)
        if isinstance(event, str):
            if self._open_type() == self.TEXT:
                return self._text(event)
            if not (self._blank + event).strip():
                self._blank += event
                return []
            event, self._blank = self._blank + event, ""
            return self._open_text() + self._text(event)
        if isinstance(event, ParsedToolCall):
            if self._max_calls is not None and self.calls >= self._max_calls:
                return []
            return self._start_call(event.name) + self._arguments(event.arguments) + self._close("completed")
        if isinstance(event, ArgumentsDelta):
            opened = self._open_type() == self.CALL
            return ([] if opened else self._start_call(event.name)) + self._arguments(event.text)
        raise TypeError(f"unexpected parser event {event!r}")

    def finish(self, status: str = "completed") -> list[Any]:
        """Closes the open part with `status`; a reply with no part at all gets its (possibly
        empty) text."""
        if self.parts:
            return self._close(status)
        out = self._open_text()
        if self._blank:
            out += self._text(self._blank)
            self._blank = ""
        return out + self._close(status)

    def _open_type(self) -> Optional[str]:
        return self._open["type"] if self._open is not None else None

    def _open_part(self, part: dict[str, Any]) -> list[Any]:
        out = self._close("completed")
        self.parts.append(part)
        self._open = part
        return out

    def _start_call(self, name: str) -> list[Any]:
        self.calls += 1
        return self._open_call(name)

    def _open_reasoning(self) -> list[Any]:
        raise NotImplementedError

    def _reasoning(self, text: str) -> list[Any]:
        raise NotImplementedError

    def _open_text(self) -> list[Any]:
        raise NotImplementedError

    def _text(self, text: str) -> list[Any]:
        raise NotImplementedError

    def _open_call(self, name: str) -> list[Any]:
        raise NotImplementedError

    def _arguments(self, text: str) -> list[Any]:
        raise NotImplementedError

    def _close(self, status: str) -> list[Any]:
        raise NotImplementedError


def template_handles_tools(template_source: Optional[str]) -> bool:
    """Whether a chat template renders `tools` itself (HF templates that support tool use read the
    `tools` variable); otherwise sluice writes them into the messages (`messages_with_tools`)."""
    return bool(template_source) and "tools" in template_source


def _system_prompt(tools: list[dict[str, Any]], call_format: str = "hermes") -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if call_format == "glm":
        how = ("To call a function, answer with its name and each argument as a key and a value between "
               "<tool_call> and </tool_call>, one block per call:\n"
               "<tool_call><function-name>\n<arg_key><argument-name></arg_key>\n"
               "<arg_value><argument-value></arg_value>\n</tool_call>")
    elif call_format == "qwen_xml":
        how = ("To call a function, answer with its name and each argument as a parameter between "
               "<tool_call> and </tool_call>, one block per call:\n"
               "<tool_call>\n<function=<function-name>>\n<parameter=<argument-name>>\n<argument-value>\n"
               "</parameter>\n</function>\n</tool_call>")
    else:
        how = ("To call a function, answer with a JSON object of its name and arguments between "
               "<tool_call> and </tool_call>, one block per call:\n"
               "<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-as-a-JSON-object>}\n</tool_call>")
    return (
        "# Tools\n\n"
        "You may call one or more functions to help with the user's request. The functions you can "
        "call are described by the JSON signatures between <tools> and </tools>:\n"
        f"<tools>\n{signatures}\n</tools>\n\n" + how
    )


def _render_call(call: dict[str, Any], call_format: str = "hermes") -> str:
    fn = call.get("function") or {}
    if call_format == "glm":
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>"
                        f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>\n"
                        for k, v in (fn.get("arguments") or {}).items())
        return f"{TOOL_CALL_START}{fn.get('name')}\n{pairs}{TOOL_CALL_END}"
    if call_format == "qwen_xml":
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         f"</parameter>\n" for k, v in (fn.get("arguments") or {}).items())
        return f"{TOOL_CALL_START}\n<function={fn.get('name')}>\n{params}</function>\n{TOOL_CALL_END}"
    return (TOOL_CALL_START + "\n"
            + json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")}, ensure_ascii=False)
            + "\n" + TOOL_CALL_END)


def messages_with_tools(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                        call_format: str = "hermes") -> list[dict[str, Any]]:
    """The calling convention of `call_format` ("hermes" or "glm") written into plain messages,
    for a template that ignores tools: the signatures in the system message (one is added first
    if there is none), assistant calls as `<tool_call>` blocks, tool results between
    `<tool_response>` tags. `arguments` must already be objects (see `arguments_as_objects`)."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_render_call(c, call_format) for c in m["tool_calls"])
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + blocks
        elif m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
    if tools:
        prompt = _system_prompt(tools, call_format)
        if out and out[0].get("role") in ("system", "developer"):
            first = out[0]
            first["content"] = (first.get("content") or "") + ("\n\n" if first.get("content") else "") + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def prepare_chat(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
                 template_source: Optional[str], call_format: str = "hermes",
                 ) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """The messages and tools to render with a chat template: calls' arguments as objects, and for
    a template that ignores tools, tools and calls written into the messages (in the convention of
    the server's tool-call parser, hermes without one). Raises ValueError for a call in the
    history whose arguments are not a JSON object."""
    messages = arguments_as_objects(messages)
    if template_handles_tools(template_source):
        return messages, tools
    return messages_with_tools(messages, tools, call_format), None


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI sends an assistant call's `arguments` as a JSON string; chat templates (and the hermes
    blocks above) expect the object. Raises ValueError for arguments that are not a JSON object."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = dict(m)
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError as e:
                        raise ValueError(f"tool call arguments are not JSON: {e}") from None
                if not isinstance(args, dict):
                    raise ValueError("tool call arguments must be a JSON object")
                fn["arguments"] = args
                c["function"] = fn
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out
