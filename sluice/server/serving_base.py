"""What chat and completion serving share: request checks, sampling parameters, workflow identity,
logprob lookup, and `GenerationStreams`, which drives the engine for one HTTP request."""
from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, TypeVar, Union

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from sluice.config import ServerConfig
from sluice.engine.async_engine import AsyncEngine, WorkflowInfo
from sluice.engine.errors import EngineDeadError, RequestRejected
from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import SamplingParams
from sluice.server.metrics import ServerMetrics
from sluice.server.protocol import REMOVED_GUIDED_FIELDS, APIError, ChatTemplateInput, PromptLogprob, SamplingRequest
from sluice.server.tool_calls import CALL_FORMATS, prepare_chat
from sluice.tokenizer import ChatTemplateError

MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry

logger = logging.getLogger(__name__)

WORKFLOW_HEADER = "x-workflow-id"
MAX_REQUEST_ID_CHARS = 256   # a client's name for its response (X-Request-Id, `request_id`)
RequestModel = TypeVar("RequestModel", bound=BaseModel)


def api_error_from(exc: BaseException) -> APIError:
    """The client-facing form of an error raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestRejected):
        headers = {}
        if exc.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        return APIError(exc.status_code, exc.message, param=exc.param, code=exc.code, headers=headers)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first invalid field (and up to three problems)."""
    errors = e.errors()
    fastapi = isinstance(e, RequestValidationError)

    def loc(err: Any) -> list[str]:   # FastAPI's locations start with where: body, query, path, ...
        where = [str(x) for x in err.get("loc", ())]
        return where[1:] if fastapi and where and where[0] in _REQUEST_PARTS else where

    parts = []
    for err in errors[:3]:
        at = ".".join(loc(err))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{at}: {msg}" if at else msg)
    if len(errors) > 3:
        parts.append(f"(and {len(errors) - 3} more)")
    first_loc = loc(errors[0]) if errors else []
    return APIError(400, "invalid request: " + "; ".join(parts), param=first_loc[0] if first_loc else None)


_REQUEST_PARTS = ("body", "query", "path", "header", "cookie")


def parse_request(model: type[RequestModel], body: Any) -> RequestModel:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from e


def raise_if_failed(output: RequestOutput) -> None:
    """A request that finished with reason "error" failed on the server's side (500)."""
    if output.error is not None or any(o.finish_reason == "error" for o in output.outputs):
        raise APIError(500, f"generation failed: {output.error or 'engine error'}", code="generation_error")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


SSE_DONE = "data: [DONE]\n\n"


def escape_line_breaks(json_text: str) -> str:
    """Escape the characters that JSON leaves raw but line readers split on (U+0085, U+2028,
    U+2029: `str.splitlines`, and with it httpx's `aiter_lines`, breaks lines there), so one SSE
    event stays one line for every client. JSON admits them only inside strings, where the
    escape means the same character."""
    if "\x85" in json_text or "\u2028" in json_text or "\u2029" in json_text:
        json_text = json_text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return json_text


def sse_event(payload: BaseModel) -> str:
    return f"data: {escape_line_breaks(payload.model_dump_json())}\n\n"


class TextChunkTemplate:
    """The SSE event of a chunk that differs from call to call only in one text field.

    Rendering a pydantic chunk per token costs a streamed request ~0.3 ms of the event loop's
    time, on the cores the model runs on. The chunk is rendered once with a sentinel as the
    text; each token's event is then the two halves around `json.dumps(text)`, the same JSON
    the model would produce (strings are the only part that changes)."""

    _SENTINEL = "\x00sluice-text\x00"

    def __init__(self, render: Callable[[str], str]) -> None:
        quoted = json.dumps(self._SENTINEL)
        parts = render(self._SENTINEL).split(quoted)
        if len(parts) != 2:
            raise ValueError("the template must contain the text field exactly once")
        self._head, self._tail = parts

    def __call__(self, text: str) -> str:
        return self._head + escape_line_breaks(json.dumps(text, ensure_ascii=False)) + self._tail


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that runs `on_close` however it ends, even if the client is
    gone before the body iterator ever started."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class EngineCall:
    """One engine request made on behalf of an HTTP request (a completions call may make several)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


_END = object()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class GenerationStreams:
    """Runs the engine generators of one HTTP request and merges their outputs.

    Each generator is consumed by its own task, so the engine's cleanup on abort runs outside
    the HTTP framework's cancel scopes. `start()` waits until every call has produced its first
    output, so an engine rejection (raised before the first output) still becomes an HTTP status
    and not a broken stream. Iterate to get `(call index, RequestOutput)` pairs. `close()` (also
    run when iteration ends or fails) cancels the tasks, which aborts unfinished engine requests.

    While a disconnect watcher is active (from `start()` until `stop_watching()`), a client
    disconnect raises `ClientDisconnected` from `start()` or the iteration.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        calls: list[EngineCall],
        workflow: WorkflowInfo,
        metrics: ServerMetrics,
        arrival: float,
    ) -> None:
        self._engine = engine
        self._calls = calls
        self._workflow = workflow
        self._metrics = metrics
        self._arrival = arrival
        self._queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._primed: deque[tuple[int, object]] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: Optional[asyncio.Task[None]] = None

    async def start(self, raw_request: Request) -> None:
        self._watcher = asyncio.create_task(_wait_for_disconnect(raw_request))
        self._tasks = [asyncio.create_task(self._produce(i, call)) for i, call in enumerate(self._calls)]
        not_started = set(range(len(self._calls)))
        try:
            while not_started:
                item = await self._next_item()
                self._primed.append(item)
                index, value = item
                if isinstance(value, BaseException):
                    raise value
                not_started.discard(index)
        except BaseException:
            self.close()
            raise

    def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def close(self) -> None:
        self.stop_watching()
        for task in self._tasks:
            task.cancel()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._calls)
        try:
            while remaining:
                index, value = self._primed.popleft() if self._primed else await self._next_item()
                if value is _END:
                    remaining -= 1
                elif isinstance(value, BaseException):
                    raise value
                else:
                    assert isinstance(value, RequestOutput)
                    yield index, value
        finally:
            self.close()

    async def _next_item(self) -> tuple[int, object]:
        if self._watcher is None:
            return await self._queue.get()
        get = asyncio.ensure_future(self._queue.get())
        await asyncio.wait({get, self._watcher}, return_when=asyncio.FIRST_COMPLETED)
        if self._watcher.done():
            get.cancel()
            raise ClientDisconnected()
        return get.result()

    async def _produce(self, index: int, call: EngineCall) -> None:
        recorder = self._metrics.recorder(self._arrival)
        outputs = self._engine.generate(call.request_id, call.prompt_token_ids, call.params, self._workflow)
        settled = False  # finished, rejected or failed: nothing left to abort
        try:
            async for output in outputs:
                recorder.observe(output)
                settled = output.finished
                self._queue.put_nowait((index, output))
            self._queue.put_nowait((index, _END))
        except RequestRejected as e:
            settled = True
            recorder.discard()
            self._queue.put_nowait((index, e))
        except Exception as e:
            settled = True
            recorder.close("error")
            self._queue.put_nowait((index, e))
        finally:
            recorder.close()
            await outputs.aclose()
            if not settled:
                # Closing the generator aborts the request, except when it is cancelled while
                # the engine is still admitting it; an explicit abort covers that window.
                await self._engine.abort(call.request_id)


class OpenAIServing:
    """Request checks and engine plumbing common to the chat and completion endpoints."""

    def __init__(
        self, engine: AsyncEngine, server_config: ServerConfig, model_name: str, metrics: ServerMetrics
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.server_config = server_config
        self.model_name = model_name
        self.metrics = metrics
        self.max_model_len = engine.config.scheduler.max_model_len
        self._token_text: dict[int, str] = {}

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )

    def check_request(self, request: SamplingRequest) -> None:
        """Bounds that depend on the server's configuration, and fields sluice does not support."""
        cfg = self.server_config
        if request.n is not None and request.n > cfg.max_n:
            raise APIError(400, f"n must be at most {cfg.max_n}", param="n")
        stops = request.stop_list
        if len(stops) > cfg.max_stop_strings:
            raise APIError(400, f"at most {cfg.max_stop_strings} stop strings are allowed", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        for key in request.logit_bias or {}:   # ids; the engine bounds them by the vocabulary
            if not (key.isascii() and key.isdigit()):   # "²".isdigit() is True
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        asked = getattr(request, "logprobs", None)     # chat: a bool; completions: a count, 0 included
        if request.logprob_token_ids is not None and (asked is None or asked is False):
            raise APIError(400, "logprob_token_ids needs logprobs", param="logprob_token_ids")
        if request.prompt_logprobs is not None:
            if request.stream:
                raise APIError(400, "prompt_logprobs is not available with stream", param="prompt_logprobs")
            self.check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens > self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens is {request.truncate_prompt_tokens}, more than this model's "
                           f"context of {self.max_model_len} tokens", param="truncate_prompt_tokens")
        if any(not w.strip() for w in request.bad_words or ()):
            raise APIError(400, "bad_words must be non-empty strings", param="bad_words")
        for name in REMOVED_GUIDED_FIELDS:
            if (request.model_extra or {}).get(name) is not None:
                raise APIError(400, f"{name} is not supported; vLLM replaced the guided_* fields with "
                               '"structured_outputs" (e.g. {"structured_outputs": {"json": <schema>}})',
                               param=name)

    async def check_structured_outputs(self, params: SamplingParams, param: str) -> None:
        """Compile the request's output constraint in a worker thread (a 400 if it is not valid);
        the engine then finds it in its grammar cache and never compiles on its step loop."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await asyncio.to_thread(self.engine.grammars.compile, spec)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    def render_chat(self, request: ChatTemplateInput) -> list[int]:
        """The prompt token ids of a chat: the served model's template over the messages (and
        tools), ending in the assistant's turn (`add_generation_prompt`) or, with
        `continue_final_message`, inside the final message, which the reply then continues."""
        if request.chat_template is not None:
            raise APIError(400, "chat_template is not accepted in a request; the server renders "
                           "with the served model's template", param="chat_template")
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        taken = sorted(self.tokenizer.reserved_template_names.intersection(kwargs))
        kwargs = {**(self.server_config.default_chat_template_kwargs or {}), **kwargs}
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}; use the request's "
                           "own fields", param="chat_template_kwargs")
        effort = getattr(request, "reasoning_effort", None)
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        if request.documents is not None:
            kwargs["documents"] = request.documents
        continue_final = bool(request.continue_final_message)
        if continue_final and request.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true "
                           "(set add_generation_prompt to false)", param="continue_final_message")
        messages = [m.to_template_dict() for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        try:
            messages, tools = prepare_chat(messages, tools, self.tokenizer.info.chat_template,
                                           CALL_FORMATS.get(self.server_config.tool_call_parser or "hermes", "hermes"))
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=bool(request.add_generation_prompt), tools=tools, **kwargs)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from e
        if continue_final:
            text = _open_final_message(text, request.messages[-1].text)
        return self.tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))

    @staticmethod
    def response_id(prefix: str, request: SamplingRequest, raw_request: Request, engine_id: str) -> str:
        """The id a response carries: vLLM's "<prefix>-<X-Request-Id header or request_id>" when
        the client names one, else the engine's own id."""
        named = raw_request.headers.get("x-request-id") or request.request_id
        if named and len(named) > MAX_REQUEST_ID_CHARS:   # it is repeated in every streamed chunk
            raise APIError(400, f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} characters", param="X-Request-Id")
        return f"{prefix}-{named}" if named else engine_id

    def truncate_prompt(self, request: SamplingRequest, prompt_ids: list[int]) -> list[int]:
        """The prompt cut to `truncate_prompt_tokens` (vLLM's: the last ones, or with `truncation_side`
        "right" the first; -1 keeps as many as leave one token of the context for output)."""
        keep = request.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep < 0:
            keep = self.max_model_len - 1
        if keep >= len(prompt_ids):
            return prompt_ids
        return prompt_ids[:keep] if request.truncation_side == "right" else prompt_ids[len(prompt_ids) - keep:]

    def check_logprobs(self, num: Optional[int], param: str) -> None:
        if num is not None and not 0 <= num <= self.server_config.max_logprobs:
            raise APIError(400, f"{param} must be in [0, {self.server_config.max_logprobs}]", param=param)

    def check_prompt_ids(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=param)
        self.check_token_ids(prompt_ids, param, "prompt token ids")

    def check_token_ids(self, ids: list[int], param: str, what: str = "token ids") -> None:
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{what} must be in [0, {vocab})", param=param)

    def resolve_max_tokens(self, requested: Optional[int], prompt_len: int, prompt_param: str) -> int:
        """`requested`, checked against the context; the room left in the context when absent."""
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens but this model's context is {self.max_model_len} "
                "tokens, which leaves no room for output",
                param=prompt_param, code="context_length_exceeded",
            )
        if requested is None:
            return room
        if requested <= 0:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        if requested > room:
            raise APIError(
                400,
                f"max_tokens is {requested} and the prompt has {prompt_len} tokens, which exceeds this "
                f"model's context of {self.max_model_len} tokens",
                param="max_tokens", code="context_length_exceeded",
            )
        return requested

    def sampling_params(
        self, request: SamplingRequest, prompt_len: int, logprobs: Optional[int], prompt_param: str,
        prompt_logprobs: Optional[int] = None, max_tokens: Optional[int] = None,
    ) -> SamplingParams:
        """`prompt_logprobs` and `max_tokens` (checked by the caller) stand in for the request's own."""
        if max_tokens is None:
            max_tokens = self.resolve_max_tokens(request.requested_max_tokens, prompt_len, prompt_param)
        if prompt_logprobs is None:
            prompt_logprobs = request.prompt_logprobs
        try:
            return request.to_sampling_params(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from e

    def prompt_logprobs_out(self, output: RequestOutput) -> Optional[list[Optional[dict[int, PromptLogprob]]]]:
        """The engine's prompt logprobs in vLLM's response shape (None where none were asked)."""
        if output.prompt_logprobs is None:
            return None
        return [None if entry is None else
                {tid: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank, decoded_token=self.token_text(tid))
                 for tid, lp in entry.items()}
                for entry in output.prompt_logprobs]

    @staticmethod
    def workflow_info(request: SamplingRequest, raw_request: Request) -> WorkflowInfo:
        workflow_id: Optional[Union[str, int]] = raw_request.headers.get(WORKFLOW_HEADER)
        if not workflow_id:
            for workflow_id in (request.workflow_id, request.session_id, request.prompt_cache_key, request.user):
                if workflow_id not in (None, ""):
                    break
        return WorkflowInfo(
            workflow_id=str(workflow_id) if workflow_id not in (None, "") else None,
            is_last_step=bool(request.is_last_step),
        )

    async def start_streams(
        self, raw_request: Request, calls: list[EngineCall], workflow: WorkflowInfo, arrival: float
    ) -> GenerationStreams:
        if self.server_config.log_requests:
            for call in calls:
                logger.info(
                    "request %s: %d prompt tokens, max_tokens=%s, n=%d, workflow=%s",
                    call.request_id, len(call.prompt_token_ids), call.params.max_tokens, call.params.n,
                    workflow.workflow_id,
                )
        streams = GenerationStreams(self.engine, calls, workflow, self.metrics, arrival)
        await streams.start(raw_request)
        return streams

    # -- logprobs ------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_label(self, token_id: int, as_id: bool) -> str:
        """How a logprob names a token: its text, or vLLM's "token_id:<id>" (return_tokens_as_token_ids),
        which names tokens whose bytes are not text of their own."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    @staticmethod
    def top_logprobs(entry: dict[int, Logprob], k: Optional[int]) -> list[Logprob]:
        """The top k of an entry; k None: all of it, in its order (with `logprob_token_ids`: the
        sampled token, then the named ones)."""
        if k is None:
            return list(entry.values())
        return sorted(entry.values(), key=lambda lp: lp.logprob, reverse=True)[:k]

    @staticmethod
    def new_logprobs(output: CompletionOutput) -> list[tuple[int, dict[int, Logprob]]]:
        """(token id, logprob entry) of the tokens added since the previous output of this sample.

        Positions come from `token_ids`, so entries appended to `logprobs` after this output was
        made (if the engine shares the list) are not picked up."""
        if not output.num_new_tokens or output.logprobs is None:
            return []
        end = len(output.token_ids)
        start = end - output.num_new_tokens
        return list(zip(output.token_ids[start:end], output.logprobs[start:end]))


def _open_final_message(text: str, final: str) -> str:
    """`text` (a rendered chat) cut right after the final message's content, so that what the
    template writes to close that message (its end-of-turn) is left for the model to continue."""
    start = text.rfind(final) if final else -1
    if start < 0:
        raise APIError(400, "continue_final_message needs a final message with content that the chat "
                       "template writes out verbatim", param="continue_final_message")
    return text[:start + len(final)]
