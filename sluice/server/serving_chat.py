"""POST /v1/chat/completions: render the chat template, generate, answer in OpenAI's chat shape."""
from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from sluice.outputs import CompletionOutput, Logprob
from sluice.server.protocol import (
    APIError,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    TopLogprob,
    UsageInfo,
    now_s,
    random_id,
)
from sluice.server.serving_base import (
    TextChunkTemplate,
    SSE_DONE,
    EngineCall,
    GenerationStreams,
    OpenAIServing,
    SSEResponse,
    api_error_from,
    raise_if_failed,
    sse_event,
)
from sluice.server.tool_calls import (
    ParsedToolCall,
    ToolCallStream,
    parse_tool_calls,
    prepare_chat,
    tool_call_id,
)
from sluice.tokenizer import ChatTemplateError

_MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(request.model)
        self.check_request(request)
        num_logprobs = self._num_logprobs(request)
        parse_tools = self._tool_parsing(request)
        prompt_ids = self._render_prompt(request)
        params = self.sampling_params(request, len(prompt_ids), num_logprobs, prompt_param="messages")
        request_id = random_id("chatcmpl")
        streams = await self.start_streams(
            raw_request,
            [EngineCall(request_id, prompt_ids, params)],
            self.workflow_info(request, raw_request),
            arrival,
        )
        if request.stream:
            streams.stop_watching()
            stream = self._stream(request, request_id, len(prompt_ids), params.n, num_logprobs, streams,
                                  parse_tools)
            return SSEResponse(stream, on_close=streams.close)
        response = await self._collect(request, request_id, len(prompt_ids), num_logprobs, streams,
                                       parse_tools)
        return Response(response.model_dump_json(), media_type="application/json")

    def _num_logprobs(self, request: ChatCompletionRequest) -> Optional[int]:
        if not request.logprobs:
            if request.top_logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        num = request.top_logprobs or 0
        self.check_logprobs(num, "top_logprobs")
        return num

    def _tool_parsing(self, request: ChatCompletionRequest) -> bool:
        """Whether this call's replies are parsed for tool calls (tool_choice "auto", the default
        with tools). "none" renders the tools but parses nothing; "required" and a named function
        need decoding constrained to a JSON schema, which sluice does not have: a 400, not a reply
        that may ignore the choice."""
        choice = request.tool_choice
        if not request.tools:
            if choice is not None and choice != "none":
                raise APIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
            return False
        if choice is None or choice == "auto":
            if not self.server_config.enable_auto_tool_choice:
                raise APIError(400, '"auto" tool choice requires the server to run with '
                               '--enable-auto-tool-choice and --tool-call-parser', param="tool_choice")
            return True
        if choice == "none":
            return False
        what = "a named function" if isinstance(choice, NamedToolChoice) else '"required"'
        raise APIError(400, f"tool_choice {what} is not supported: it needs decoding constrained to the "
                       'tool\'s JSON schema; use "auto" or "none"', param="tool_choice")

    def _render_prompt(self, request: ChatCompletionRequest) -> list[int]:
        messages = [m.to_template_dict() for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        try:
            messages, tools = prepare_chat(messages, tools, self.tokenizer.info.chat_template)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from e
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_prompt_ids(prompt_ids, "messages")
        return prompt_ids

    async def _collect(
        self, request: ChatCompletionRequest, request_id: str, prompt_len: int,
        num_logprobs: Optional[int], streams: GenerationStreams, parse_tools: bool,
    ) -> ChatCompletionResponse:
        latest: dict[int, CompletionOutput] = {}
        cached_tokens = 0
        async for _, output in streams:
            for sample in output.outputs:
                latest[sample.index] = sample
            if output.finished:
                cached_tokens = output.num_cached_tokens
                raise_if_failed(output)
        choices = []
        for index in sorted(latest):
            sample = latest[index]
            logprobs = None
            if num_logprobs is not None:
                logprobs = self._chat_logprobs(list(zip(sample.token_ids, sample.logprobs or [])), num_logprobs)
            content, calls = parse_tool_calls(sample.text) if parse_tools else (sample.text, [])
            if calls and request.parallel_tool_calls is False:
                calls = calls[:1]
            choices.append(ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(content=content, tool_calls=[
                    ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in calls]),
                logprobs=logprobs,
                finish_reason=_finish_reason(sample.finish_reason, bool(calls)),
                stop_reason=sample.stop_reason,
            ))
        completion_tokens = sum(len(s.token_ids) for s in latest.values())
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo.of(prompt_len, completion_tokens, cached_tokens),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_len: int,
        n: int,
        num_logprobs: Optional[int],
        streams: GenerationStreams,
        parse_tools: bool = False,
    ) -> AsyncIterator[str]:
        created = now_s()

        def chunk(choices: list[ChatCompletionStreamChoice], usage: Optional[UsageInfo] = None) -> str:
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage,
            ))

        latest: dict[int, CompletionOutput] = {}
        finished: set[int] = set()
        text_chunk: dict[int, TextChunkTemplate] = {}   # per choice: its content-only chunk
        parsers: dict[int, ToolCallStream] = {}          # per choice, when parsing tool calls
        num_calls: dict[int, int] = {}                   # per choice: tool calls sent
        cached_tokens = 0
        try:
            for index in range(n):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for _, output in streams:
                for sample in output.outputs:
                    latest[sample.index] = sample
                    if sample.index in finished:
                        continue
                    done = bool(sample.finish_reason) and sample.finish_reason != "error"
                    # What this output adds, in order: content strings and (when parsing tool
                    # calls) whole calls; text that may open a <tool_call> is held back.
                    events: list = [sample.text_delta] if sample.text_delta else []
                    if parse_tools:
                        parser = parsers.setdefault(sample.index, ToolCallStream())
                        events = parser.feed(sample.text_delta) if sample.text_delta else []
                        if done:
                            events += parser.finish()
                    new_logprobs = self.new_logprobs(sample) if num_logprobs is not None else []
                    if new_logprobs:
                        text = events.pop(0) if events and isinstance(events[0], str) else ""
                        logprobs = self._chat_logprobs(new_logprobs, num_logprobs)
                        yield chunk([ChatCompletionStreamChoice(
                            index=sample.index, delta=DeltaMessage(content=text), logprobs=logprobs,
                        )])
                    for event in events:
                        if isinstance(event, ParsedToolCall):
                            k = num_calls.get(sample.index, 0)
                            if k and request.parallel_tool_calls is False:
                                continue
                            num_calls[sample.index] = k + 1
                            yield chunk([ChatCompletionStreamChoice(index=sample.index, delta=DeltaMessage(
                                tool_calls=[DeltaToolCall(index=k, id=tool_call_id(), function=DeltaFunctionCall(
                                    name=event.name, arguments=event.arguments))]))])
                            continue
                        if sample.index not in text_chunk:
                            text_chunk[sample.index] = TextChunkTemplate(
                                lambda t, i=sample.index: chunk([ChatCompletionStreamChoice(
                                    index=i, delta=DeltaMessage(content=t))]))
                        yield text_chunk[sample.index](event)
                    if done:
                        finished.add(sample.index)
                        yield chunk([ChatCompletionStreamChoice(
                            index=sample.index, delta=DeltaMessage(),
                            finish_reason=_finish_reason(sample.finish_reason, sample.index in num_calls),
                            stop_reason=sample.stop_reason,
                        )])
                if output.finished:
                    cached_tokens = output.num_cached_tokens
                    raise_if_failed(output)
            if request.include_usage:
                completion_tokens = sum(len(s.token_ids) for s in latest.values())
                yield chunk([], usage=UsageInfo.of(prompt_len, completion_tokens, cached_tokens))
        except Exception as e:
            yield sse_event(api_error_from(e).to_body())
        yield SSE_DONE

    def _chat_logprobs(self, tokens: list[tuple[int, dict[int, Logprob]]], num_top: int) -> ChatLogprobs:
        content = []
        for token_id, entry in tokens:
            chosen = entry.get(token_id)
            text = self.token_text(token_id)
            content.append(ChatTokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else _MIN_LOGPROB,
                bytes=list(text.encode()),
                top_logprobs=[self._top_logprob(lp) for lp in self.top_logprobs(entry, num_top)],
            ))
        return ChatLogprobs(content=content)

    def _top_logprob(self, logprob: Logprob) -> TopLogprob:
        text = self.token_text(logprob.token_id)
        return TopLogprob(token=text, logprob=logprob.logprob, bytes=list(text.encode()))


def _finish_reason(reason: Optional[str], made_calls: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for a reply that ended on its own after calling tools."""
    return "tool_calls" if made_calls and reason == "stop" else reason
