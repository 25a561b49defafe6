"""POST /v1/completions: one engine request per prompt, answered in OpenAI's completions shape.

Choice `index` is `prompt_index * n + sample_index`, as OpenAI numbers them for a batch of prompts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Optional

from starlette.requests import Request
from starlette.responses import Response

from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.server.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
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
    raise_if_failed,
    sse_event,
)



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
        engine_id = random_id("cmpl")
        request_id = self.response_id("cmpl", request, raw_request, engine_id)
        # `echo` with `logprobs` scores the prompt too (OpenAI's legacy API; what evaluation
        # harnesses send), and with `max_tokens: 0` returns only the prompt (one token is still
        # generated: the engine samples at the end of every prompt).
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(request.logprobs, prompt_logprobs or 0)
        calls = [
            EngineCall(
                engine_id if len(prompts) == 1 else f"{engine_id}-{i}",
                prompt.token_ids,
                self.sampling_params(
                    request, len(prompt.token_ids), request.logprobs, prompt_param="prompt",
                    prompt_logprobs=prompt_logprobs,
                    max_tokens=(self.resolve_max_tokens(1, len(prompt.token_ids), "prompt")
                                if self._echo_only(request) else None),
                ),
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
        if request.logprob_token_ids is not None and request.echo and request.logprobs is not None:
            raise APIError(400, "logprob_token_ids cannot be combined with echo and logprobs (the prompt's "
                           "entries hold its top logprobs)", param="logprob_token_ids")
        if request.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise APIError(400, "best_of is not supported (other than best_of == n)", param="best_of")
        self.check_logprobs(request.logprobs, "logprobs")

    @staticmethod
    def _echo_only(request: CompletionRequest) -> bool:
        return bool(request.echo) and request.max_tokens == 0

    def _tokenize(self, request: CompletionRequest) -> list[_Prompt]:
        prompts = []
        for prompt in request.prompts:
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens is not False)
                kept = self.truncate_prompt(request, ids)
                prompts.append(_Prompt(kept, prompt if len(kept) == len(ids) else None))   # echo: what ran
            else:
                prompts.append(_Prompt(self.truncate_prompt(request, list(prompt)), None))
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
        finals: dict[int, RequestOutput] = {}
        cached_tokens = 0
        async for call_index, output in streams:
            for sample in output.outputs:
                latest[call_index * n + sample.index] = sample
            if output.finished:
                finals[call_index] = output
                cached_tokens += output.num_cached_tokens
                raise_if_failed(output)
        echo_only = self._echo_only(request)
        choices = []
        for index in sorted(latest):
            sample, output = latest[index], finals[index // n]
            logprobs = None
            if request.logprobs is not None:
                tokens = self._echo_logprobs(request, output) + (
                    [] if echo_only else list(zip(sample.token_ids, sample.logprobs or [])))
                logprobs, _ = self._completion_logprobs(tokens, self._num_top(request), 0,
                                                        bool(request.return_tokens_as_token_ids))
            ids = bool(request.return_token_ids)
            choices.append(CompletionResponseChoice(
                index=index,
                text=self._echo_text(request, prompts[index // n]) + ("" if echo_only else sample.text),
                logprobs=logprobs,
                finish_reason="length" if echo_only else sample.finish_reason,
                stop_reason=None if echo_only else sample.stop_reason,
                prompt_logprobs=self.prompt_logprobs_out(output) if request.prompt_logprobs is not None else None,
                prompt_token_ids=list(prompts[index // n].token_ids) if ids else None,
                token_ids=([] if echo_only else list(sample.token_ids)) if ids else None,
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
        continuous = request.continuous_usage
        hits: dict[int, int] = {}   # per call: its prefix-cache hits, once known

        def usage_so_far() -> UsageInfo:
            return self._usage(prompts, latest.values(), sum(hits.values()))

        def chunk(choices: list[CompletionChoice], usage: Optional[UsageInfo] = None) -> str:
            if continuous and usage is None:
                usage = usage_so_far()
            return sse_event(CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage,
            ))

        latest: dict[int, CompletionOutput] = {}
        finished: set[int] = set()
        text_offsets: dict[int, int] = {}
        text_chunk: dict[int, TextChunkTemplate] = {}   # per choice: its text-only chunk
        echo_only = self._echo_only(request)
        # return_token_ids: a choice's first chunk carries its prompt's ids, and every chunk the
        # ids generated since the choice's previous chunk.
        ids = bool(request.return_token_ids)
        pending_ids: dict[int, list[int]] = {}
        as_ids = bool(request.return_tokens_as_token_ids)
        try:
            async for call_index, output in streams:
                hits[call_index] = output.num_cached_tokens
                for sample in output.outputs:
                    index = call_index * n + sample.index
                    latest[index] = sample
                    if index in finished:
                        continue
                    text, echoed = ("", []) if echo_only else (sample.text_delta, self.new_logprobs(sample))
                    first = index not in text_offsets
                    if first:
                        text = self._echo_text(request, prompts[call_index]) + text
                        echoed = self._echo_logprobs(request, output) + echoed
                        text_offsets[index] = 0
                    if ids and sample.num_new_tokens and not echo_only:
                        new = sample.token_ids[len(sample.token_ids) - sample.num_new_tokens:]
                        pending_ids.setdefault(index, []).extend(new)
                    logprobs = None
                    if request.logprobs is not None and echoed:
                        logprobs, text_offsets[index] = self._completion_logprobs(
                            echoed, self._num_top(request), text_offsets[index], as_ids
                        )
                    finish_reason = sample.finish_reason if sample.finish_reason != "error" else None
                    if echo_only and finish_reason:
                        finish_reason = "length"
                    if finish_reason:
                        finished.add(index)
                    if (ids or continuous) and (text or logprobs or finish_reason or first):
                        yield chunk([CompletionChoice(
                            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                            stop_reason=sample.stop_reason if finish_reason and not echo_only else None,
                            prompt_token_ids=list(prompts[call_index].token_ids) if first and ids else None,
                            token_ids=pending_ids.pop(index, []) if ids else None,
                        )])
                    elif text and not logprobs and not finish_reason:
                        if index not in text_chunk:
                            text_chunk[index] = TextChunkTemplate(
                                lambda t, i=index: chunk([CompletionChoice(index=i, text=t)]))
                        yield text_chunk[index](text)
                    elif text or logprobs or finish_reason:
                        yield chunk([CompletionChoice(
                            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                            stop_reason=sample.stop_reason if finish_reason and not echo_only else None,
                        )])
                if output.finished:
                    raise_if_failed(output)
            if request.include_usage:
                yield chunk([], usage=usage_so_far())
        except Exception as e:
            yield sse_event(api_error_from(e).to_body())
        yield SSE_DONE

    @staticmethod
    def _usage(prompts: list[_Prompt], samples: Iterable[CompletionOutput], cached_tokens: int) -> UsageInfo:
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return UsageInfo.of(sum(len(p.token_ids) for p in prompts), completion_tokens, cached_tokens)

    @staticmethod
    def _echo_logprobs(request: CompletionRequest, output: RequestOutput) -> list[tuple[int, Optional[dict[int, Logprob]]]]:
        """(token id, logprob entry) of the prompt, when `echo` and `logprobs` put it in the logprobs."""
        if not request.echo or request.logprobs is None or output.prompt_logprobs is None:
            return []
        return list(zip(output.prompt_token_ids, output.prompt_logprobs))

    @staticmethod
    def _num_top(request: CompletionRequest) -> Optional[int]:
        """Top logprobs per token: `logprobs`, or with `logprob_token_ids` every entry (the sampled
        token and the named ones)."""
        return None if request.logprob_token_ids else request.logprobs

    def _completion_logprobs(
        self, tokens: list[tuple[int, Optional[dict[int, Logprob]]]], num_top: Optional[int], text_offset: int,
        as_ids: bool = False,
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of `tokens` in the completions format, and the text offset after them. A
        token without an entry (a prompt's first) has null for its logprob and its top ones."""
        result = CompletionLogprobs()
        for token_id, entry in tokens:
            text = self.token_text(token_id)
            result.tokens.append(self.token_label(token_id, as_ids))
            result.text_offset.append(text_offset)
            text_offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen = entry.get(token_id)
            result.token_logprobs.append(chosen.logprob if chosen is not None else MIN_LOGPROB)
            # OpenAI: "the API will always return the logprob of the sampled token, so there may
            # be up to logprobs+1 elements" (vLLM too: the token first, then the top ones).
            top = {result.tokens[-1]: result.token_logprobs[-1]}
            for lp in self.top_logprobs(entry, num_top):
                top.setdefault(self.token_label(lp.token_id, as_ids), lp.logprob)
            result.top_logprobs.append(top)
        return result, text_offset
