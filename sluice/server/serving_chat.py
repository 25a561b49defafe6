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
from sluice.tokenizer import ChatTemplateError

_MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(request.model)
        self.check_request(request)
        num_logprobs = self._num_logprobs(request)
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
            stream = self._stream(request, request_id, len(prompt_ids), params.n, num_logprobs, streams)
            return SSEResponse(stream, on_close=streams.close)
        response = await self._collect(request_id, len(prompt_ids), num_logprobs, streams)
        return Response(response.model_dump_json(), media_type="application/json")

    def _num_logprobs(self, request: ChatCompletionRequest) -> Optional[int]:
        if not request.logprobs:
            if request.top_logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
            return None
        num = request.top_logprobs or 0
        self.check_logprobs(num, "top_logprobs")
        return num

    def _render_prompt(self, request: ChatCompletionRequest) -> list[int]:
        messages = [m.to_template_dict() for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from e
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_prompt_ids(prompt_ids, "messages")
        return prompt_ids

    async def _collect(
        self, request_id: str, prompt_len: int, num_logprobs: Optional[int], streams: GenerationStreams
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
            choices.append(ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(content=sample.text),
                logprobs=logprobs,
                finish_reason=sample.finish_reason,
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
    ) -> AsyncIterator[str]:
        created = now_s()

        def chunk(choices: list[ChatCompletionStreamChoice], usage: Optional[UsageInfo] = None) -> str:
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage,
            ))

        latest: dict[int, CompletionOutput] = {}
        finished: set[int] = set()
        text_chunk: dict[int, TextChunkTemplate] = {}   # per choice: its content-only chunk
        cached_tokens = 0
        try:
            for index in range(n):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            async for _, output in streams:
                for sample in output.outputs:
                    latest[sample.index] = sample
                    if sample.index in finished:
                        continue
                    new_logprobs = self.new_logprobs(sample) if num_logprobs is not None else []
                    if new_logprobs:
                        logprobs = self._chat_logprobs(new_logprobs, num_logprobs)
                        yield chunk([ChatCompletionStreamChoice(
                            index=sample.index, delta=DeltaMessage(content=sample.text_delta), logprobs=logprobs,
                        )])
                    elif sample.text_delta:
                        if sample.index not in text_chunk:
                            text_chunk[sample.index] = TextChunkTemplate(
                                lambda t, i=sample.index: chunk([ChatCompletionStreamChoice(
                                    index=i, delta=DeltaMessage(content=t))]))
                        yield text_chunk[sample.index](sample.text_delta)
                    if sample.finish_reason and sample.finish_reason != "error":
                        finished.add(sample.index)
                        yield chunk([ChatCompletionStreamChoice(
                            index=sample.index, delta=DeltaMessage(),
                            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
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

