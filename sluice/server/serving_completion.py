"""POST /v1/completions: one engine request per prompt, answered in OpenAI's completions shape.

Choice `index` is `prompt_index * n + sample_index`, as OpenAI numbers them for a batch of prompts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Optional

from starlette.requests import Request
from starlette.responses import Response

from sluice.outputs import CompletionOutput, Logprob
from sluice.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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

_MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry


@dataclass
class _Prompt:
    token_ids: list[int]
    text: Optional[str]  # as the client sent it; None for token-id prompts


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(request.model)
        self.check_request(request)
        self._check_completion_fields(request)
        prompts = self._tokenize(request)
        request_id = random_id("cmpl")
        calls = [
            EngineCall(
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                prompt.token_ids,
                self.sampling_params(request, len(prompt.token_ids), request.logprobs, prompt_param="prompt"),
            )
            for i, prompt in enumerate(prompts)
        ]
        await self.check_structured_outputs(calls[0].params, request.structured_outputs_field)
        streams = await self.start_streams(raw_request, calls, self.workflow_info(request, raw_request), arrival)
        n = calls[0].params.n
        if request.stream:
            streams.stop_watching()
            return SSEResponse(self._stream(request, request_id, prompts, n, streams), on_close=streams.close)
        response = await self._collect(request, request_id, prompts, n, streams)
        return Response(response.model_dump_json(), media_type="application/json")

    def _check_completion_fields(self, request: CompletionRequest) -> None:
        if request.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise APIError(400, "best_of is not supported (other than best_of == n)", param="best_of")
        self.check_logprobs(request.logprobs, "logprobs")
        if request.echo and request.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported", param="echo")

    def _tokenize(self, request: CompletionRequest) -> list[_Prompt]:
        prompts = []
        for prompt in request.prompts:
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens is not False)
                prompts.append(_Prompt(ids, prompt))
            else:
                prompts.append(_Prompt(list(prompt), None))
            self.check_prompt_ids(prompts[-1].token_ids, "prompt")
        return prompts

    def _echo_text(self, request: CompletionRequest, prompt: _Prompt) -> str:
        if not request.echo:
            return ""
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    async def _collect(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        n: int,
        streams: GenerationStreams,
    ) -> CompletionResponse:
        latest: dict[int, CompletionOutput] = {}
        cached_tokens = 0
        async for call_index, output in streams:
            for sample in output.outputs:
                latest[call_index * n + sample.index] = sample
            if output.finished:
                cached_tokens += output.num_cached_tokens
                raise_if_failed(output)
        choices = []
        for index in sorted(latest):
            sample = latest[index]
            logprobs = None
            if request.logprobs is not None:
                tokens = list(zip(sample.token_ids, sample.logprobs or []))
                logprobs, _ = self._completion_logprobs(tokens, request.logprobs, 0)
            choices.append(CompletionChoice(
                index=index,
                text=self._echo_text(request, prompts[index // n]) + sample.text,
                logprobs=logprobs,
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            ))
        return CompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=self._usage(prompts, latest.values(), cached_tokens),
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        n: int,
        streams: GenerationStreams,
    ) -> AsyncIterator[str]:
        created = now_s()

        def chunk(choices: list[CompletionChoice], usage: Optional[UsageInfo] = None) -> str:
            return sse_event(CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage,
            ))

        latest: dict[int, CompletionOutput] = {}
        finished: set[int] = set()
        text_offsets: dict[int, int] = {}
        text_chunk: dict[int, TextChunkTemplate] = {}   # per choice: its text-only chunk
        cached_tokens = 0
        try:
            async for call_index, output in streams:
                for sample in output.outputs:
                    index = call_index * n + sample.index
                    latest[index] = sample
                    if index in finished:
                        continue
                    text = sample.text_delta
                    if index not in text_offsets:
                        text = self._echo_text(request, prompts[call_index]) + text
                        text_offsets[index] = 0
                    logprobs = None
                    if request.logprobs is not None and sample.num_new_tokens:
                        logprobs, text_offsets[index] = self._completion_logprobs(
                            self.new_logprobs(sample), request.logprobs, text_offsets[index]
                        )
                    finish_reason = sample.finish_reason if sample.finish_reason != "error" else None
                    if finish_reason:
                        finished.add(index)
                    if text and not logprobs and not finish_reason:
                        if index not in text_chunk:
                            text_chunk[index] = TextChunkTemplate(
                                lambda t, i=index: chunk([CompletionChoice(index=i, text=t)]))
                        yield text_chunk[index](text)
                    elif text or logprobs or finish_reason:
                        yield chunk([CompletionChoice(
                            index=index, text=text, logprobs=logprobs,
                            finish_reason=finish_reason, stop_reason=sample.stop_reason if finish_reason else None,
                        )])
                if output.finished:
                    cached_tokens += output.num_cached_tokens
                    raise_if_failed(output)
            if request.include_usage:
                yield chunk([], usage=self._usage(prompts, latest.values(), cached_tokens))
        except Exception as e:
            yield sse_event(api_error_from(e).to_body())
        yield SSE_DONE

    @staticmethod
    def _usage(prompts: list[_Prompt], samples: Iterable[CompletionOutput], cached_tokens: int) -> UsageInfo:
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return UsageInfo.of(sum(len(p.token_ids) for p in prompts), completion_tokens, cached_tokens)

    def _completion_logprobs(
        self, tokens: list[tuple[int, dict[int, Logprob]]], num_top: int, text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of `tokens` in the completions format, and the text offset after them."""
        result = CompletionLogprobs()
        for token_id, entry in tokens:
            text = self.token_text(token_id)
            chosen = entry.get(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(chosen.logprob if chosen is not None else _MIN_LOGPROB)
            result.top_logprobs.append(
                {self.token_text(lp.token_id): lp.logprob for lp in self.top_logprobs(entry, num_top)}
            )
            result.text_offset.append(text_offset)
            text_offset += len(text)
        return result, text_offset
