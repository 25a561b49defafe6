"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

Agent harnesses built on Anthropic's API (its SDKs, coding agents pointed at `ANTHROPIC_BASE_URL`)
reach sluice here, as they reach vLLM 0.32's own `/v1/messages`. A request is translated into the
chat completion it amounts to: `system` becomes the system message; content blocks become chat
messages (an assistant's `tool_use` blocks its `tool_calls`, a user's `tool_result` blocks tool
messages ahead of the user's text, thinking blocks replayed from history the assistant turn's
`reasoning`); `tools`
(`input_schema`) and `tool_choice` (`auto`, `any` = "required", `tool` = a named function, `none`,
`disable_parallel_tool_use`) become the chat's; `stop_sequences` its `stop`; a final assistant
message is continued (Anthropic's response prefill; vLLM 0.32 opens a new turn after it);
`output_config.format` a `response_format`. It then goes through the chat endpoint's checks,
template, tool parsing and structured outputs. The answer has Anthropic's shape: `text` and
`tool_use` content blocks, `stop_reason` (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`),
usage with the prefix cache's hits as `cache_read_input_tokens` (Anthropic's `input_tokens` counts
only the rest), and, streamed, Anthropic's events (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta` / `input_json_delta`, `content_block_stop`,
`message_delta`, `message_stop`). Errors come in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`; api_server.py).

Workflow identity: the X-Workflow-Id header, `workflow_id`, `session_id`, then `metadata.user_id`
(which Anthropic's coding agents set per session), so an agent's calls find their KV retained.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Literal, Optional, Union

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from sluice.outputs import CompletionOutput, RequestOutput
from sluice.server.protocol import APIError, ChatCompletionRequest, OpenAIRequestModel, documented
from sluice.server.serving_base import (
    EngineCall,
    GenerationStreams,
    SSEResponse,
    api_error_from,
    escape_line_breaks,
    parse_request,
    raise_if_failed,
)
from sluice.server.serving_chat import OpenAIServingChat
from sluice.server.tool_calls import ReplyParts, sample_events

# A chat field named in an error -> the Messages field it came from.
_CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}

# Anthropic's error types by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


MESSAGES_PATH = "/v1/messages"


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(error.status_code, "api_error" if error.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(error: APIError, path: str) -> dict[str, Any]:
    """An error's body for a request to `path`: Anthropic's shape on its Messages API (/v1/messages
    and below), OpenAI's everywhere else."""
    return anthropic_error_body(error) if path.startswith(MESSAGES_PATH) else error.to_body().model_dump()


# --- requests ------------------------------------------------------------------------------------

class ContentBlock(OpenAIRequestModel):
    """A content block of a message (or of `system`); which fields count depends on `type`."""

    type: str
    text: Optional[str] = None
    id: Optional[str] = None                                 # tool_use
    name: Optional[str] = None                               # tool_use
    input: Optional[dict[str, Any]] = None                   # tool_use
    tool_use_id: Optional[str] = None                        # tool_result
    content: Optional[Union[str, list[dict[str, Any]]]] = None   # tool_result
    is_error: Optional[bool] = None                          # tool_result
    thinking: Optional[str] = None                           # thinking
    signature: Optional[str] = None                          # thinking


class AnthropicMessage(OpenAIRequestModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class AnthropicTool(OpenAIRequestModel):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    type: Optional[str] = None        # "custom" (or absent); Anthropic's own tools are not served


class AnthropicToolChoice(OpenAIRequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class _Conversation(OpenAIRequestModel):
    model: Optional[str] = None
    messages: list[AnthropicMessage]
    system: Optional[Union[str, list[ContentBlock]]] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[dict[str, Any]] = None


class MessagesRequest(_Conversation):
    """POST /v1/messages. Fields Anthropic's API does not declare are passed on as they would be on
    a chat completion (vLLM's sampling extensions, `cache_salt`, `ignore_eos`, ...)."""

    max_tokens: int = documented(..., minimum=1)
    stop_sequences: Optional[list[str]] = None
    stream: Optional[bool] = False
    temperature: Optional[float] = documented(minimum=0)
    top_p: Optional[float] = documented(exclusiveMinimum=0, maximum=1)
    top_k: Optional[int] = documented(minimum=-1)
    metadata: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    workflow_id: Optional[Union[str, int]] = None
    session_id: Optional[str] = None
    is_last_step: Optional[bool] = False


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt a Messages request with these fields runs on."""


# --- the translation -----------------------------------------------------------------------------

def _text_of(blocks: Union[str, list[ContentBlock], list[dict[str, Any]], None], where: str, param: str) -> str:
    """The text of a system prompt or a tool result: a string, or text blocks joined by lines."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for block in blocks:
        kind, text = (block.get("type"), block.get("text")) if isinstance(block, dict) else (block.type, block.text)
        if kind != "text":
            raise APIError(400, f"{where}: content blocks of type {kind!r} are not supported (text only)",
                           param=param)
        texts.append(text or "")
    return "\n".join(texts)


def chat_messages(request: _Conversation) -> list[dict[str, Any]]:
    """The chat messages a Messages conversation amounts to."""
    out: list[dict[str, Any]] = []
    system = _text_of(request.system, "system", "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thoughts: list[str] = []
        for block in message.content:
            kind = block.type
            if kind == "text":
                texts.append(block.text or "")
            elif kind == "tool_use" and message.role == "assistant":
                if not block.name:
                    raise APIError(400, f"messages[{i}]: a tool_use block needs a name", param="messages")
                calls.append({"id": block.id or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
            elif kind == "tool_result" and message.role == "user":
                # ahead of the user's own text: the results answer the assistant's calls just before
                out.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                            "content": _text_of(block.content, f"messages[{i}] tool_result", "messages")})
            elif kind == "thinking" and message.role == "assistant":
                thoughts.append(block.thinking or "")   # the turn's reasoning, for the template
            elif kind == "redacted_thinking" and message.role == "assistant":
                continue            # opaque (encrypted by Anthropic): nothing a template can render
            else:
                raise APIError(400, f"messages[{i}]: content blocks of type {kind!r} are not supported in "
                               f"{message.role} messages", param="messages")
        if message.role == "assistant":
            if texts or calls or thoughts:
                out.append({"role": "assistant", "content": "\n".join(texts) if texts else None,
                            **({"tool_calls": calls} if calls else {}),
                            **({"reasoning": "".join(thoughts)} if thoughts else {})})
        elif texts:
            out.append({"role": "user", "content": [{"type": "text", "text": t} for t in texts]})
    return out


def prefill(request: _Conversation) -> dict[str, Any]:
    """Anthropic's response prefill: a final assistant message (text only) is continued, not
    followed by a new turn (the chat endpoint's `continue_final_message`); the reply is what
    comes after it."""
    last = request.messages[-1] if request.messages else None
    if last is None or last.role != "assistant":
        return {}
    blocks = [last.content] if isinstance(last.content, str) else last.content
    if any(not isinstance(b, str) and b.type != "text" for b in blocks):
        return {}
    return {"continue_final_message": True, "add_generation_prompt": False}


def chat_tools(request: _Conversation) -> dict[str, Any]:
    """The chat request's `tools`, `tool_choice` and `parallel_tool_calls`."""
    body: dict[str, Any] = {}
    for tool in request.tools or []:
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tool {tool.name!r} of type {tool.type!r}: Anthropic's own tools are not "
                           "served; define it as a custom tool", param="tools")
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": {"type": "object", **t.input_schema}}} for t in request.tools]
    choice = request.tool_choice
    if choice is None:
        if request.tools:
            body["tool_choice"] = "auto"
        return body
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, 'tool_choice of type "tool" needs a name', param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    return body


def _check_thinking(request: _Conversation) -> None:
    thinking = request.thinking or {}
    kind = thinking.get("type")
    if kind not in (None, "disabled", "enabled", "adaptive"):
        raise APIError(400, f"thinking of type {kind!r} is not supported", param="thinking")
    budget = thinking.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise APIError(400, "thinking.budget_tokens must be a non-negative integer", param="thinking")
    # "enabled" and "adaptive" are accepted. With `--reasoning-parser` the thinking comes back as
    # thinking blocks (unless the request disabled thinking) and "enabled"'s budget_tokens bounds
    # each thought (vLLM's mapping to thinking_token_budget); without one the server does not know
    # the model's thinking, so there is none to bound.


def stop_reason(sample: CompletionOutput, called: bool) -> tuple[Optional[str], Optional[str]]:
    """Anthropic's (stop_reason, stop_sequence) for a finished sample."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if sample.finish_reason == "stop" and isinstance(sample.stop_reason, str):
        return "stop_sequence", sample.stop_reason
    # vLLM's "repetition" (repetition_detection) has no Anthropic reason; it ends as vLLM's does.
    return ("tool_use" if called else "end_turn"), None


class ContentBlocks(ReplyParts):
    """The content blocks of one reply (`thinking`, `text`, `tool_use`), built from its parser's
    events as they come (ReplyParts); each method returns the stream events it causes."""

    REASONING = "thinking"
    TEXT = "text"
    CALL = "tool_use"

    def __init__(self, max_calls: Optional[int]) -> None:
        super().__init__(max_calls)
        self._json = ""                # the open tool_use block's arguments so far

    @property
    def blocks(self) -> list[dict[str, Any]]:
        return self.parts

    def _open_part(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        return super()._open_part(block) + [
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _open_reasoning(self) -> list[dict[str, Any]]:
        return self._open_part({"type": "thinking", "thinking": "", "signature": ""})

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        self._open["thinking"] += text
        return [self._delta({"type": "thinking_delta", "thinking": text})]

    def _open_text(self) -> list[dict[str, Any]]:
        return self._open_part({"type": "text", "text": ""})

    def _text(self, text: str) -> list[dict[str, Any]]:
        self._open["text"] += text
        return [self._delta({"type": "text_delta", "text": text})]

    def _open_call(self, name: str) -> list[dict[str, Any]]:
        self._json = ""
        return self._open_part({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": name, "input": {}})

    def _arguments(self, text: str) -> list[dict[str, Any]]:
        self._json += text
        return [self._delta({"type": "input_json_delta", "partial_json": text})] if text else []

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self, status: str) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            try:
                args = json.loads(self._json) if self._json.strip() else {}
            except json.JSONDecodeError:
                args = None
            block["input"] = args if isinstance(args, dict) else {}
        if block["type"] == "thinking":
            # Anthropic signs thinking so a client can send it back unaltered; this server keeps no
            # key, so the signature only marks the block as this server's (vLLM sends a random one).
            block["signature"] = uuid.uuid4().hex
            return [self._delta({"type": "signature_delta", "signature": block["signature"]}),
                    {"type": "content_block_stop", "index": len(self.blocks) - 1}]
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


# --- the endpoint --------------------------------------------------------------------------------

class AnthropicServingMessages(OpenAIServingChat):
    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(request.model)
        _check_thinking(request)
        chat, parse_reply, prompt_ids, params = await self.prepare_translated(
            self._chat_body(request, self.engine.config.reasoning is not None), "messages", "output_config",
            _CHAT_PARAMS)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        streams = await self.start_streams(raw_request, [EngineCall(message_id, prompt_ids, params)],
                                           self.workflow_info(chat, raw_request), arrival)
        reply = _Reply(self.model_name, message_id, len(prompt_ids), parse_reply,
                       1 if chat.parallel_tool_calls is False else None)
        if request.stream:
            streams.stop_watching()
            return SSEResponse(reply.stream(streams), on_close=streams.close)
        async for _, output in streams:
            reply.update(output)
        return Response(json.dumps(reply.finish(), ensure_ascii=False), media_type="application/json")

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        self.check_model(request.model)
        _check_thinking(request)
        body = {"model": request.model, "messages": chat_messages(request), **chat_tools(request), **prefill(request)}
        body.pop("tool_choice", None)        # parsing the reply is not asked for: the prompt is the same
        chat = parse_request(ChatCompletionRequest, body)
        return {"input_tokens": len(self.render_chat(chat))}

    @staticmethod
    def _chat_body(request: MessagesRequest, thinks: bool) -> dict[str, Any]:
        """The chat request a message request is; `thinks`: the engine knows the model's thinking
        tags (a thinking budget can be kept)."""
        body: dict[str, Any] = dict(request.model_extra or {})   # fields Anthropic's API does not declare
        if body.get("prompt_logprobs") is not None:
            raise APIError(400, "prompt_logprobs is not served by /v1/messages (use /v1/completions or "
                           "/v1/chat/completions)", param="prompt_logprobs")
        for name in ("mcp_servers", "container"):
            if body.pop(name, None):
                raise APIError(400, f"{name} is not supported", param=name)
        user = (request.metadata or {}).get("user_id")
        body.update(
            model=request.model, messages=chat_messages(request), n=1, stream=False,
            max_completion_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k, stop=request.stop_sequences, user=str(user) if user not in (None, "") else None,
            workflow_id=request.workflow_id, session_id=request.session_id, is_last_step=request.is_last_step,
            **chat_tools(request), **prefill(request),
        )
        thinking = request.thinking or {}
        if thinking.get("type") == "disabled":
            body["include_reasoning"] = False
        elif thinking.get("type") == "enabled" and thinks and thinking.get("budget_tokens") is not None:
            body.setdefault("thinking_token_budget", thinking["budget_tokens"])
        fmt = (request.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}',
                               param="output_config")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        return body


class _Reply:
    """One message being generated: the engine's outputs through the tool parser into content
    blocks, and the final message."""

    def __init__(self, model: str, message_id: str, prompt_len: int, parse_reply: Optional[Callable[[], Any]],
                 max_calls: Optional[int]) -> None:
        self.model = model
        self.message_id = message_id
        self.prompt_len = prompt_len
        self.parser = parse_reply() if parse_reply is not None else None
        self.blocks = ContentBlocks(max_calls)
        self.sample: Optional[CompletionOutput] = None
        self.cached_tokens = 0

    def update(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The stream events of one engine output (raises if the request failed)."""
        events: list[dict[str, Any]] = []
        self.cached_tokens = output.num_cached_tokens
        for sample in output.outputs:
            self.sample = sample
            for event in sample_events(self.parser, sample):
                events += self.blocks.add(event)
        if output.finished:
            raise_if_failed(output)
        return events

    def usage(self, final: bool) -> dict[str, Any]:
        output_tokens = len(self.sample.token_ids) if self.sample is not None and final else 0
        return {"input_tokens": self.prompt_len - self.cached_tokens, "cache_read_input_tokens": self.cached_tokens,
                "cache_creation_input_tokens": 0, "output_tokens": output_tokens}

    def message(self, content: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        reason, sequence = stop_reason(self.sample, self.blocks.calls > 0) if final and self.sample else (None, None)
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage(final)}

    def finish(self) -> dict[str, Any]:
        self.blocks.finish()
        return self.message(self.blocks.blocks, final=True)

    async def stream(self, streams: GenerationStreams) -> AsyncIterator[str]:
        def sse(event: dict[str, Any]) -> str:
            return f"event: {event['type']}\ndata: {escape_line_breaks(json.dumps(event, ensure_ascii=False))}\n\n"

        started = False
        try:
            async for _, output in streams:
                events = self.update(output)
                if not started:     # after the first output: its prefix-cache hits are known
                    started = True
                    yield sse({"type": "message_start", "message": self.message([], final=False)})
                    yield sse({"type": "ping"})
                for event in events:
                    yield sse(event)
            for event in self.blocks.finish():
                yield sse(event)
            final = self.message([], final=True)
            yield sse({"type": "message_delta", "delta": {"stop_reason": final["stop_reason"],
                                                          "stop_sequence": final["stop_sequence"]},
                       "usage": final["usage"]})
            yield sse({"type": "message_stop"})
        except Exception as e:
            yield sse({"type": "error", **{k: v for k, v in anthropic_error_body(api_error_from(e)).items()
                                           if k != "type"}})
