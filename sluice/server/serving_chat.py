"""POST /v1/chat/completions: render the chat template, generate, answer in OpenAI's chat shape."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator, Callable, Optional

from starlette.requests import Request
from starlette.responses import Response

from sluice.engine.thinking import ThoughtTracker
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
    CompletionTokensDetails,
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
    MIN_LOGPROB,
    TextChunkTemplate,
    SSE_DONE,
    EngineCall,
    GenerationStreams,
    OpenAIServing,
    SSEResponse,
    api_error_from,
    parse_request,
    raise_if_failed,
    sse_event,
)
from sluice.server.tool_calls import (
    ArgumentsDelta,
    NamedCallStream,
    ParsedToolCall,
    RequiredCallsStream,
    call_parser_factory,
    named_call_schema,
    reply_parts,
    required_calls_schema,
    tool_call_id,
)
from sluice.server.reasoning import ReasoningDelta, ReasoningStream, reasoning_text, starts_in_reasoning
from sluice.sampling_params import SamplingParams, StructuredOutputsParams



class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(request.model)
        self.check_request(request)
        num_logprobs = self._num_logprobs(request)
        parse_tools, forced = self._tool_choice(request)
        prompt_ids = self.truncate_prompt(request, self.render_chat(request))
        self.check_prompt_ids(prompt_ids, "messages")
        params = self.sampling_params(request, len(prompt_ids), num_logprobs, prompt_param="messages")
        if request.prediction is not None and request.prediction.text:
            try:
                params = dataclasses.replace(params, prediction=self.tokenizer.encode(
                    request.prediction.text, add_special_tokens=False))
            except ValueError as e:
                raise APIError(400, str(e), param="prediction") from e
        if forced is not None:
            try:
                params = dataclasses.replace(params, structured_outputs=forced)
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from e
        await self.check_structured_outputs(
            params, "tool_choice" if forced is not None else request.structured_outputs_field)
        parse_reply = self.reply_parser(prompt_ids, params, parse_tools, request.include_reasoning is not False)
        engine_id = random_id("chatcmpl")
        request_id = self.response_id("chatcmpl", request, raw_request, engine_id)
        streams = await self.start_streams(
            raw_request,
            [EngineCall(engine_id, prompt_ids, params)],
            self.workflow_info(request, raw_request),
            arrival,
        )
        if request.stream:
            streams.stop_watching()
            stream = self._stream(request, request_id, prompt_ids, params.n, num_logprobs, streams,
                                  parse_reply)
            return SSEResponse(stream, on_close=streams.close)
        response = await self._collect(request, request_id, prompt_ids, num_logprobs, streams,
                                       parse_reply)
        return Response(response.model_dump_json(), media_type="application/json")

    async def prepare_translated(
        self, body: dict[str, Any], prompt_param: str, format_param: str, param_names: dict[str, str],
    ) -> tuple[ChatCompletionRequest, Optional[Callable[[], Any]], list[int], SamplingParams]:
        """A request of another API (Responses, Anthropic's Messages) as the chat completion `body`
        it amounts to: the chat endpoint's checks, template and sampling parameters, its errors
        naming the other API's fields (`param_names`: chat field -> theirs). Returns the chat
        request, its reply parser factory (tool calls, reasoning), its prompt and its sampling
        parameters."""
        try:
            chat = parse_request(ChatCompletionRequest, body)
            self.check_request(chat)
            parse_tools, forced = self._tool_choice(chat)
            prompt_ids = self.truncate_prompt(chat, self.render_chat(chat))
            self.check_prompt_ids(prompt_ids, prompt_param)
            params = self.sampling_params(chat, len(prompt_ids), None, prompt_param=prompt_param)
            if forced is not None:
                params = dataclasses.replace(params, structured_outputs=forced)
            await self.check_structured_outputs(params, "tool_choice" if forced is not None else format_param)
        except APIError as e:
            e.param = param_names.get(e.param, e.param)
            raise
        return (chat, self.reply_parser(prompt_ids, params, parse_tools, chat.include_reasoning is not False),
                prompt_ids, params)

    def reply_parser(self, prompt_ids: list[int], params: SamplingParams, parse_tools: Optional[Callable[[], Any]],
                     include_reasoning: bool = True) -> Optional[Callable[[], Any]]:
        """The factory of per-choice reply parsers: `parse_tools` (tool calls, or None for plain
        text) inside a reasoning split when the server has a reasoning parser (the reasoning left
        out unless `include_reasoning`). A constrained reply (structured outputs, a forced tool
        choice) thinks freely first where the engine lets it (its grammar starts after the thought,
        as vLLM's does): a thought the prompt opens, or one the reply opens with its first token
        where the start tag is one token; after that thought its text is all content. Otherwise
        it is constrained from its first token, and all content."""
        if self.server_config.reasoning_parser is None:
            return parse_tools
        if params.structured_outputs is None:
            in_reasoning = starts_in_reasoning(self.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False))
            return lambda: ReasoningStream(in_reasoning, parse_tools, include_reasoning)
        # constrained: the engine's reading of the prompt (the tags in tokens), which decides where
        # its grammar starts
        tags = self.engine.thinking_tags
        thought = ThoughtTracker(tags, None, prompt_ids) if tags is not None else None
        if thought is None or not thought.may_think:
            return parse_tools
        return lambda: ReasoningStream(thought.opens_in_prompt, parse_tools, include_reasoning, leading=True)

    def prompt_text(self, request: ChatCompletionRequest, prompt_ids: list[int]) -> Optional[str]:
        """vLLM's `return_prompt_text`: the text of the prompt the model ran on (after truncation)."""
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False) if request.return_prompt_text else None

    def _num_logprobs(self, request: ChatCompletionRequest) -> Optional[int]:
        if not request.logprobs:
            if request.top_logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        num = request.top_logprobs or 0
        self.check_logprobs(num, "top_logprobs")
        return num

    def _tool_choice(self, request: ChatCompletionRequest) -> tuple[Optional[Callable[[], Any]], Optional[StructuredOutputsParams]]:
        """How this call's replies are read for tool calls: a factory of per-choice parsers (None:
        the reply is plain content), and the constraint a forced choice puts on the reply.
        "auto" (the default with tools) parses hermes blocks and needs the server's flags; "none"
        renders the tools but parses nothing; "required" and a named function constrain the reply
        to the calls' JSON schema (tool_calls.py)."""
        choice = request.tool_choice
        if not request.tools:
            if choice is not None and choice != "none":
                raise APIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
            return None, None
        tools = [t.model_dump(exclude_none=True) for t in request.tools]
        if choice is None or choice == "auto":
            if not self.server_config.enable_auto_tool_choice:
                raise APIError(400, '"auto" tool choice requires the server to run with '
                               '--enable-auto-tool-choice and --tool-call-parser', param="tool_choice")
            return call_parser_factory(self.server_config.tool_call_parser, tools), None
        if choice == "none":
            return None, None
        fmt = request.response_format
        if (fmt is not None and fmt.type != "text") or request.structured_outputs is not None:
            raise APIError(400, "a forced tool_choice cannot be combined with response_format or "
                           "structured_outputs", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            try:
                schema = named_call_schema(tools, name)
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from e
            return (lambda: NamedCallStream(name)), StructuredOutputsParams(json=schema)
        schema = required_calls_schema(tools, parallel=request.parallel_tool_calls is not False)
        return RequiredCallsStream, StructuredOutputsParams(json=schema)

    async def _collect(
        self, request: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
        num_logprobs: Optional[int], streams: GenerationStreams, parse_reply: Optional[Callable[[], Any]],
    ) -> ChatCompletionResponse:
        ids = bool(request.return_token_ids)
        latest: dict[int, CompletionOutput] = {}
        cached_tokens, prompt_logprobs = 0, None
        async for _, output in streams:
            for sample in output.outputs:
                latest[sample.index] = sample
            if output.finished:
                cached_tokens = output.num_cached_tokens
                raise_if_failed(output)
                prompt_logprobs = self.prompt_logprobs_out(output)
        choices = []
        for index in sorted(latest):
            sample = latest[index]
            logprobs = None
            if num_logprobs is not None:
                logprobs = self._chat_logprobs(list(zip(sample.token_ids, sample.logprobs or [])),
                                               None if request.logprob_token_ids else num_logprobs,
                                               bool(request.return_tokens_as_token_ids))
            content, calls, parsed, reasoning = sample.text, [], False, None
            if parse_reply is not None:
                parser = parse_reply()
                events = parser.feed(sample.text) + parser.finish()
                content, calls, parsed = reply_parts(events)
                reasoning = reasoning_text(events)
            if calls and request.parallel_tool_calls is False:
                calls = calls[:1]
            if request.echoed_text:
                content = request.echoed_text + (content or "")
            choices.append(ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(content=content, reasoning=reasoning, tool_calls=[
                    ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                    for c in calls]),
                logprobs=logprobs,
                finish_reason=_finish_reason(sample.finish_reason, parsed),
                stop_reason=sample.stop_reason,
                token_ids=list(sample.token_ids) if ids else None,
            ))
        completion_tokens = sum(len(s.token_ids) for s in latest.values())
        return ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=UsageInfo.of(len(prompt_ids), completion_tokens, cached_tokens, CompletionTokensDetails.of(latest.values())),
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=list(prompt_ids) if ids else None,
            prompt_text=self.prompt_text(request, prompt_ids),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_ids: list[int],
        n: int,
        num_logprobs: Optional[int],
        streams: GenerationStreams,
        parse_reply: Optional[Callable[[], Any]] = None,
    ) -> AsyncIterator[str]:
        created = now_s()
        prompt_len = len(prompt_ids)
        # return_token_ids: the prompt's ids ride on the first chunk, and each choice's new ids on
        # its next chunk (text the tool parser holds back leaves them pending until it is sent).
        ids = bool(request.return_token_ids)
        pending_ids: dict[int, list[int]] = {}
        as_ids = bool(request.return_tokens_as_token_ids)

        continuous = request.continuous_usage

        def usage_so_far() -> UsageInfo:
            return UsageInfo.of(prompt_len, sum(len(s.token_ids) for s in latest.values()), cached_tokens,
                                CompletionTokensDetails.of(latest.values()))

        def chunk(choices: list[ChatCompletionStreamChoice], usage: Optional[UsageInfo] = None,
                  first: bool = False) -> str:
            if continuous and usage is None:
                usage = usage_so_far()
            if ids:
                for c in choices:
                    if c.index in pending_ids:
                        c.token_ids = pending_ids.pop(c.index)
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage,
                prompt_token_ids=list(prompt_ids) if ids and first else None,
                prompt_text=self.prompt_text(request, prompt_ids) if first else None,
            ))

        latest: dict[int, CompletionOutput] = {}
        finished: set[int] = set()
        text_chunk: dict[int, TextChunkTemplate] = {}   # per choice: its content-only chunk
        parsers: dict[int, Any] = {}                     # per choice, when parsing tool calls or reasoning
        num_calls: dict[int, int] = {}                   # per choice: parsed tool calls sent
        named_call: set[int] = set()                     # choices whose named call has begun
        cached_tokens = 0                                # the prefix-cache hits, once known
        try:
            for index in range(n):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                            first=index == 0)
            if request.echoed_text:
                for index in range(n):
                    yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=request.echoed_text))])
            async for _, output in streams:
                cached_tokens = output.num_cached_tokens
                for sample in output.outputs:
                    latest[sample.index] = sample
                    if sample.index in finished:
                        continue
                    if ids and sample.num_new_tokens:
                        new = sample.token_ids[len(sample.token_ids) - sample.num_new_tokens:]
                        pending_ids.setdefault(sample.index, []).extend(new)
                    done = bool(sample.finish_reason) and sample.finish_reason != "error"
                    # What this output adds, in order: content strings and (when parsing tool
                    # calls) whole calls; text that may open a <tool_call> is held back.
                    events: list = [sample.text_delta] if sample.text_delta else []
                    if parse_reply is not None:
                        parser = parsers.get(sample.index) or parsers.setdefault(sample.index, parse_reply())
                        events = parser.feed(sample.text_delta) if sample.text_delta else []
                        if done:
                            events += parser.finish()
                    new_logprobs = self.new_logprobs(sample) if num_logprobs is not None else []
                    if new_logprobs:
                        text = events.pop(0) if events and isinstance(events[0], str) else ""
                        logprobs = self._chat_logprobs(new_logprobs, None if request.logprob_token_ids else num_logprobs,
                                                       as_ids)
                        yield chunk([ChatCompletionStreamChoice(
                            index=sample.index, delta=DeltaMessage(content=text), logprobs=logprobs,
                        )])
                    for event in events:
                        if isinstance(event, ReasoningDelta):
                            yield chunk([ChatCompletionStreamChoice(index=sample.index,
                                                                    delta=DeltaMessage(reasoning=event.text))])
                            continue
                        if isinstance(event, ArgumentsDelta):
                            first = sample.index not in named_call
                            named_call.add(sample.index)
                            yield chunk([ChatCompletionStreamChoice(index=sample.index, delta=DeltaMessage(
                                tool_calls=[DeltaToolCall(
                                    index=0, id=tool_call_id() if first else None,
                                    type="function" if first else None,
                                    function=DeltaFunctionCall(name=event.name if first else None,
                                                               arguments=event.text))]))])
                            continue
                        if isinstance(event, ParsedToolCall):
                            k = num_calls.get(sample.index, 0)
                            if k and request.parallel_tool_calls is False:
                                continue
                            num_calls[sample.index] = k + 1
                            yield chunk([ChatCompletionStreamChoice(index=sample.index, delta=DeltaMessage(
                                tool_calls=[DeltaToolCall(index=k, id=tool_call_id(), type="function", function=DeltaFunctionCall(
                                    name=event.name, arguments=event.arguments))]))])
                            continue
                        if ids or continuous:      # each chunk's ids or usage differ: no shared template
                            yield chunk([ChatCompletionStreamChoice(index=sample.index, delta=DeltaMessage(content=event))])
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
                    raise_if_failed(output)
            if request.include_usage:
                yield chunk([], usage=usage_so_far())
        except Exception as e:
            yield sse_event(api_error_from(e).to_body())
        yield SSE_DONE

    def _chat_logprobs(self, tokens: list[tuple[int, dict[int, Logprob]]], num_top: Optional[int],
                       as_ids: bool = False) -> ChatLogprobs:
        content = []
        for token_id, entry in tokens:
            chosen = entry.get(token_id)
            text = self.token_label(token_id, as_ids)
            content.append(ChatTokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else MIN_LOGPROB,
                bytes=list(text.encode()),
                top_logprobs=[self._top_logprob(lp, as_ids) for lp in self.top_logprobs(entry, num_top)],
            ))
        return ChatLogprobs(content=content)

    def _top_logprob(self, logprob: Logprob, as_ids: bool = False) -> TopLogprob:
        text = self.token_label(logprob.token_id, as_ids)
        return TopLogprob(token=text, logprob=logprob.logprob, bytes=list(text.encode()))


def _finish_reason(reason: Optional[str], made_calls: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for a reply that ended on its own after calling tools."""
    return "tool_calls" if made_calls and reason == "stop" else reason
