"""POST /v1/responses: OpenAI's Responses API (text and function tools) on the chat path.

A request is translated into the chat completion it amounts to (its `input` items and
`instructions` become messages, `tools` and `tool_choice` the chat's, `text.format` a
`response_format`), which then goes through the chat endpoint's checks, template, tool parsing
and structured outputs; only the answer's shape differs: output items (an assistant `message`
with `output_text`, `function_call`s) and, streamed, the Responses events (`response.created`,
`response.output_item.added`, `response.output_text.delta`, ..., `response.completed`).

Conversation state: a response made with `store` (the default, as at OpenAI) is kept in a bounded
in-memory store (`--responses-store-size`, least recently used first out), so a next call can send
only its new items with `previous_response_id`; GET and DELETE /v1/responses/{id} read and drop
one, and GET /v1/responses/{id}/input_items lists the items it was made from (the whole
conversation: the chain's earlier inputs and outputs, then its own input), newest first by default,
in pages (`limit`, `after`, `order`), as OpenAI lists them. A chain of responses is one workflow
for the scheduler (its first response's id, unless the call names a workflow), so a follow-up
finds its conversation's KV retained.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response

from sluice.outputs import CompletionOutput
from sluice.server.protocol import (
    APIError,
    ResponsesRequest,
    now_s,
)
from sluice.server.serving_base import (
    WORKFLOW_HEADER,
    EngineCall,
    GenerationStreams,
    SSEResponse,
    api_error_from,
    escape_line_breaks,
    raise_if_failed,
)
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.tool_calls import ReplyParts, sample_events, tool_call_id

INPUT_ROLES = ("user", "system", "developer", "assistant")

# A chat field named in an error -> the Responses field it came from.
_CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                "response_format": "text"}


@dataclass
class StoredResponse:
    response: dict[str, Any]          # the response object as it was answered
    messages: list[dict[str, Any]]    # the conversation so far as chat messages, without instructions
    workflow_id: Optional[str]        # the chain's workflow
    input_items: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what it was made from, with ids


class ResponseStore:
    """Stored responses by id, at most `capacity`, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[response_id] = item
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def not_found(response_id: str, param: Optional[str] = None) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (responses are kept in memory, the "
                    "most recent --responses-store-size of them)", param=param, code="response_not_found")


# --- input items -> chat messages ------------------------------------------------------------

def _text_of(content: Any, where: str) -> str:
    """A message's content (or a call's output): a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: content part type {kind!r} is not supported; only text parts "
                           "(input_text, output_text)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_of(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"{where}: a reasoning item's content and summary must be lists of text parts",
                       param="input")
    return "".join(p["text"] for p in parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses `input`: messages, the model's earlier reasoning and
    function calls (one assistant message per turn, its reasoning as `reasoning`) and the calls'
    outputs (tool messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        last = messages[-1] if messages else None
        if kind == "reasoning":
            text = _reasoning_of(item, where)
            if last is not None and last["role"] == "assistant" and not last["content"] and not last.get("tool_calls"):
                last["reasoning"] = last.get("reasoning", "") + text
            else:
                messages.append({"role": "assistant", "content": "", "reasoning": text})
        elif kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(INPUT_ROLES)}", param="input")
            content = _text_of(item.get("content"), where + ".content")
            if (role == "assistant" and last is not None and last["role"] == "assistant" and "reasoning" in last
                    and not last["content"] and not last.get("tool_calls")):
                last["content"] = content          # the answer after its reasoning: one turn
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(arguments, str) and isinstance(call_id, str)):
                raise APIError(400, f"{where}: a function_call needs string name, arguments and call_id",
                               param="input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output needs a string call_id", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where + ".output")})
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, "
                           "reasoning, function_call, function_call_output)", param="input")
    return messages


def input_item_objects(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` as the items GET /v1/responses/{id}/input_items lists: each with an id
    (its own if it came with one) and a status, message content as a list of parts. Call only on
    an input that `input_messages` accepted."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        given = item.get("id") if isinstance(item.get("id"), str) else None   # "" counts as none
        if kind == "message":
            content = item["content"]
            texts = [content] if isinstance(content, str) else [p["text"] for p in content]
            parts = ([{"type": "output_text", "text": t, "annotations": []} for t in texts]
                     if item["role"] == "assistant" else [{"type": "input_text", "text": t} for t in texts])
            listed.append({"id": given or _item_id("msg"), "type": "message", "role": item["role"],
                           "content": parts, "status": "completed"})
        elif kind == "function_call":
            listed.append({"id": given or _item_id("fc"), "type": "function_call", "call_id": item["call_id"],
                           "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif kind == "reasoning":
            listed.append({"id": given or _item_id("rs"), "type": "reasoning", "summary": item.get("summary") or [],
                           "content": item.get("content") or [], "status": "completed"})
        else:
            listed.append({"id": given or _item_id("fco"), "type": "function_call_output", "call_id": item["call_id"],
                           "output": _text_of(item["output"], "output"), "status": "completed"})
    return listed


INPUT_ITEMS_ORDERS = ("asc", "desc")


def list_items(items: list[dict[str, Any]], after: Optional[str], limit: Optional[int], order: Optional[str],
               include: Optional[list[str]]) -> dict[str, Any]:
    """One page of `items` as OpenAI's list object (`order` desc: newest first, the default)."""
    if include:
        raise APIError(400, f"include is not supported (asked for {', '.join(include)})", param="include")
    limit = 20 if limit is None else limit
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be between 1 and 100, got {limit}", param="limit")
    order = order or "desc"
    if order not in INPUT_ITEMS_ORDERS:
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"no input item with id {after!r} in this response", param="after")
        start = ids.index(after) + 1
    page = ordered[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(ordered)}


def output_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant chat message of a response's output items (for the stored conversation)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    reasoning = [part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]]
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


# --- output items, built from the parser's events ------------------------------------------------

class OutputItems(ReplyParts):
    """The output items of one reply (an assistant `message`, `function_call`s), built from its
    parser's events as they come (ReplyParts); each method returns the stream events it causes,
    as (type, fields) pairs."""

    TEXT = "message"
    CALL = "function_call"

    @property
    def items(self) -> list[dict[str, Any]]:
        return self.parts

    def _open_part(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Closes the open item (completed) and opens `item` after it."""
        return super()._open_part(item) + [
            ("response.output_item.added", {"output_index": len(self.items) - 1, "item": _copy(item)})]

    def _open_reasoning(self) -> list[tuple[str, dict[str, Any]]]:
        item = {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
        return self._open_part(item) + [("response.content_part.added", {
            "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0,
            "part": {"type": "reasoning_text", "text": ""}})]

    def _reasoning(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        item = self._open
        assert item is not None and item["type"] == "reasoning"
        item["content"][0]["text"] += text
        return [("response.reasoning_text.delta", {"item_id": item["id"], "output_index": len(self.items) - 1,
                                                   "content_index": 0, "delta": text})]

    def _open_text(self) -> list[tuple[str, dict[str, Any]]]:
        item = {"type": "message", "id": _item_id("msg"), "status": "in_progress", "role": "assistant",
                "content": []}
        return self._open_part(item) + [("response.content_part.added", {
            "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0, "part": _text_part("")})]

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        item = self._open
        assert item is not None and item["type"] == "message"
        if not item["content"]:
            item["content"].append(_text_part(""))
        item["content"][0]["text"] += text
        return [("response.output_text.delta", {"item_id": item["id"], "output_index": len(self.items) - 1,
                                                "content_index": 0, "delta": text, "logprobs": []})]

    def _open_call(self, name: str) -> list[tuple[str, dict[str, Any]]]:
        return self._open_part({"type": "function_call", "id": _item_id("fc"), "call_id": tool_call_id(),
                                "name": name, "arguments": "", "status": "in_progress"})

    def _arguments(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        item = self._open
        assert item is not None and item["type"] == "function_call"
        item["arguments"] += text
        return [("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": len(self.items) - 1,
                                                            "delta": text})]

    def _close(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self.items) - 1
        if item["type"] == "function_call":
            return [("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                               "name": item["name"], "arguments": item["arguments"]}),
                    ("response.output_item.done", {"output_index": index, "item": _copy(item)})]
        if item["type"] == "reasoning":
            part = item["content"][0]
            return [("response.reasoning_text.done", {"item_id": item["id"], "output_index": index,
                                                      "content_index": 0, "text": part["text"]}),
                    ("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                    "content_index": 0, "part": dict(part)}),
                    ("response.output_item.done", {"output_index": index, "item": _copy(item)})]
        if not item["content"]:
            item["content"].append(_text_part(""))
        part = item["content"][0]
        return [("response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                               "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0,
                                                "part": dict(part)}),
                ("response.output_item.done", {"output_index": index, "item": _copy(item)})]


def _item_id(prefix: str) -> str:
    """OpenAI's Responses ids: resp_..., msg_..., fc_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


# --- the endpoint --------------------------------------------------------------------------------

class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, *args: Any, store_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = ResponseStore(store_size)

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(request.model)
        self._check_fields(request)
        previous = None
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id, param="previous_response_id")
        history = list(previous.messages) if previous is not None else []
        new_messages = input_messages(request.input)
        if not new_messages:
            raise APIError(400, "input must hold at least one item", param="input")
        # The stored items are final (never mutated again), so a chain shares them instead of copying.
        items = (previous.input_items + previous.response["output"] if previous is not None
                 else []) + input_item_objects(request.input)
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat, parse_reply, prompt_ids, params = await self.prepare_translated(
            self._chat_body(request, system + history + new_messages), "input", "text", _CHAT_PARAMS)
        response_id = _item_id("resp")
        workflow = self.workflow_info(chat, raw_request)
        if (not raw_request.headers.get(WORKFLOW_HEADER) and request.workflow_id is None and not request.session_id
                and not request.prompt_cache_key):
            # the chain is the workflow: the first response's id, carried by the stored ones
            chain = previous.workflow_id if previous is not None else (response_id if request.store else None)
            if chain is not None:
                workflow = dataclasses.replace(workflow, workflow_id=chain)
        streams = await self.start_streams(raw_request, [EngineCall(response_id, prompt_ids, params)], workflow,
                                           arrival)
        reply = _Reply(self, request, response_id, len(prompt_ids), parse_reply, history + new_messages,
                       workflow.workflow_id, items)
        if request.stream:
            streams.stop_watching()
            return SSEResponse(reply.stream(streams), on_close=streams.close)
        async for _, output in streams:
            reply.update(output)
        return Response(json.dumps(reply.finish(), ensure_ascii=False), media_type="application/json")

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    def input_items(self, response_id: str, after: Optional[str], limit: Optional[int], order: Optional[str],
                    include: Optional[list[str]]) -> dict[str, Any]:
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return list_items(stored.input_items, after, limit, order, include)

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _check_fields(self, request: ResponsesRequest) -> None:
        if request.background:
            raise APIError(400, "background responses are not supported", param="background")
        if request.include:
            raise APIError(400, f"include is not supported (asked for {', '.join(request.include)})", param="include")
        if request.top_logprobs:
            raise APIError(400, "top_logprobs is not supported on /v1/responses; use /v1/chat/completions",
                           param="top_logprobs")
        if request.truncation == "auto":
            raise APIError(400, 'truncation "auto" is not supported: a conversation longer than the context '
                           "is a 400, never silently cut", param="truncation")
        if request.reasoning and any(v is not None for v in request.reasoning.values()):
            if self.server_config.reasoning_parser is None:
                raise APIError(400, "this server does not parse reasoning (--reasoning-parser); reasoning "
                               "options are not supported", param="reasoning")
            unknown = sorted(set(request.reasoning) - {"effort", "summary", "generate_summary"})
            if unknown:
                raise APIError(400, f"unknown reasoning options {unknown}", param="reasoning")

    @staticmethod
    def _chat_body(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = dict(request.model_extra or {})   # fields the Responses API does not declare
        if body.get("prompt_logprobs") is not None:   # it would be computed (the whole prompt, uncached) and lost
            raise APIError(400, "prompt_logprobs is not served by /v1/responses (use /v1/completions or "
                           "/v1/chat/completions)", param="prompt_logprobs")
        body.update(
            model=request.model, messages=messages, n=1, stream=False,
            max_completion_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
            parallel_tool_calls=request.parallel_tool_calls, user=request.user, workflow_id=request.workflow_id,
            session_id=request.session_id, prompt_cache_key=request.prompt_cache_key, is_last_step=request.is_last_step,
        )
        if request.reasoning and request.reasoning.get("effort") is not None:
            body["reasoning_effort"] = request.reasoning["effort"]
        if request.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type", "strict"}, exclude_none=True)}
                             for t in request.tools]
        choice = request.tool_choice
        if choice is not None:
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                         "function": {"name": choice.name}}
        elif request.tools:
            body["tool_choice"] = "auto"
        fmt = request.text.format if request.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise APIError(400, 'text.format of type "json_schema" needs a schema', param="text")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        return body

    def response_object(self, request: ResponsesRequest, response_id: str, created: int, status: str,
                        output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        fmt = request.text.format.model_dump(by_alias=True, exclude_none=True) if (
            request.text is not None and request.text.format is not None) else {"type": "text"}
        choice = request.tool_choice
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.model_name, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": (request.reasoning or {}).get("effort"), "summary": None} if request.reasoning else None,
            "store": bool(request.store), "temperature": 1.0 if request.temperature is None else request.temperature,
            "text": {"format": fmt},
            "tool_choice": choice if isinstance(choice, str) else (
                choice.model_dump() if choice is not None else ("auto" if request.tools else "none")),
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "top_p": 1.0 if request.top_p is None else request.top_p, "truncation": "disabled",
            "usage": usage, "user": request.user, "metadata": request.metadata or {}, "background": False,
        }


class _Reply:
    """One response being generated: feeds the engine's outputs through the tool parser into
    output items, and gives the final response object (stored when the request says so)."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest, response_id: str,
                 prompt_len: int, parse_reply: Optional[Callable[[], Any]], conversation: list[dict[str, Any]],
                 workflow_id: Optional[str], input_items: list[dict[str, Any]]) -> None:
        self.serving = serving
        self.request = request
        self.response_id = response_id
        self.created = now_s()
        self.prompt_len = prompt_len
        self.parser = parse_reply() if parse_reply is not None else None
        self.items = OutputItems(max_calls=1 if request.parallel_tool_calls is False else request.max_tool_calls)
        self.conversation = conversation
        self.workflow_id = workflow_id
        self.input_items = input_items
        self.sample: Optional[CompletionOutput] = None
        self.cached_tokens = 0

    def update(self, output: Any) -> list[tuple[str, dict[str, Any]]]:
        """The stream events of one engine output (raises if the request failed)."""
        events: list[tuple[str, dict[str, Any]]] = []
        for sample in output.outputs:
            self.sample = sample
            for event in sample_events(self.parser, sample):
                events += self.items.add(event)
        if output.finished:
            self.cached_tokens = output.num_cached_tokens
            raise_if_failed(output)
        return events

    @property
    def status(self) -> str:
        return "incomplete" if self.sample is not None and self.sample.finish_reason == "length" else "completed"

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        return self.items.finish(self.status)

    def final(self) -> dict[str, Any]:
        output_tokens = len(self.sample.token_ids) if self.sample is not None else 0
        usage = {"input_tokens": self.prompt_len, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.prompt_len + output_tokens}
        response = self.serving.response_object(self.request, self.response_id, self.created, self.status,
                                                self.items.items, usage)
        if self.request.store:
            self.serving.store.put(self.response_id, StoredResponse(
                response, self.conversation + [output_message(self.items.items)], self.workflow_id,
                self.input_items))
        return response

    def finish(self) -> dict[str, Any]:
        self.close()
        return self.final()

    async def stream(self, streams: GenerationStreams) -> AsyncIterator[str]:
        sequence = iter(range(1 << 62))

        def sse(kind: str, fields: dict[str, Any]) -> str:
            payload = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {escape_line_breaks(json.dumps(payload, ensure_ascii=False))}\n\n"

        def lifecycle(kind: str, status: str) -> str:
            return sse(kind, {"response": self.serving.response_object(
                self.request, self.response_id, self.created, status, [])})

        try:
            yield lifecycle("response.created", "in_progress")
            yield lifecycle("response.in_progress", "in_progress")
            async for _, output in streams:
                for kind, fields in self.update(output):
                    yield sse(kind, fields)
            for kind, fields in self.close():
                yield sse(kind, fields)
            final = self.final()
            yield sse("response.completed" if final["status"] == "completed" else "response.incomplete",
                      {"response": final})
        except Exception as e:
            error = api_error_from(e)
            yield sse("error", {"code": error.code or error.type, "message": error.message, "param": error.param})

