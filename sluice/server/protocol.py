"""OpenAI-compatible request and response schemas (pydantic v2), and the error contract.

Requests accept unknown fields (clients send many we do not use) and carry the usual engine
extensions that benchmark tools send (`ignore_eos`, `top_k`, `min_tokens`, ...), plus the workflow
fields sluice's scheduler uses (`workflow_id`, `is_last_step`).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterable, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    field_validator,
    model_serializer,
)

from sluice.sampling_params import (
    MAX_CACHE_SALT_CHARS, STREAM_FINAL_ONLY, ParamError, RepetitionDetectionParams, SamplingParams,
    StructuredOutputsParams,
)

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def documented(default: Any = None, **schema: Any) -> Any:
    """A field whose bounds are stated in the OpenAPI schema (for clients and the fuzz test) but
    checked where the error message is better: in `SamplingParams` or the serving layer."""
    return Field(default, json_schema_extra=schema)


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


_ERROR_TYPES = {
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error"
        )
        self.headers = headers or {}

    def to_body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class OpenAIRequestModel(BaseModel):
    """Unknown fields are kept, never rejected."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIRequestModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False   # vLLM's: usage so far in every chunk too


_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"   # OpenAI's rule for function (and response format) names


class JsonSchemaFormat(OpenAIRequestModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    name: str = Field(..., pattern=_FUNCTION_NAME)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIRequestModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema; or vLLM's
    structural tags (`structures` of {begin, schema, end} and their `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[Any]] = None
    triggers: Optional[list[Any]] = None
    format: Optional[Any] = None   # xgrammar's newer structural tag form: a 400


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` (extra_body): exactly one constraint; unknown keys are a 400, so a
    constraint sluice does not know is never silently ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    structural_tag: Optional[str] = None   # vLLM's: the JSON text of {"structures": [...], "triggers": [...]}
    disable_any_whitespace: Optional[bool] = None
    disable_additional_properties: Optional[bool] = None
    whitespace_pattern: Optional[str] = None


class RepetitionDetectionRequest(BaseModel):
    """vLLM's `repetition_detection`: end generation once the output repeats a pattern of
    min_pattern_size..max_pattern_size tokens min_count times in a row (finish reason
    "repetition"). Unknown keys are a 400."""

    model_config = ConfigDict(extra="forbid")

    max_pattern_size: int = Field(0, ge=0, le=_INT64_MAX)
    min_pattern_size: int = Field(0, ge=0, le=_INT64_MAX)
    min_count: int = Field(0, ge=0, le=_INT64_MAX)


# vLLM's request fields for guided decoding before `structured_outputs` replaced them.
REMOVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                         "guided_json_object", "guided_decoding_backend", "guided_whitespace_pattern")


class SamplingRequest(OpenAIRequestModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = documented(minimum=1)
    temperature: Optional[float] = documented(minimum=0)
    top_p: Optional[float] = documented(exclusiveMinimum=0, maximum=1)
    n: Optional[int] = documented(1, minimum=1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: Optional[float] = documented(minimum=-2, maximum=2)
    frequency_penalty: Optional[float] = documented(minimum=-2, maximum=2)
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # Engine extensions (vLLM names).
    ignore_eos: Optional[bool] = False
    min_tokens: Optional[int] = documented(0, minimum=0)
    top_k: Optional[int] = documented(minimum=-1)
    min_p: Optional[float] = documented(minimum=0, maximum=1)
    repetition_penalty: Optional[float] = documented(exclusiveMinimum=0)
    stop_token_ids: Optional[list[int]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    logprob_token_ids: Optional[list[int]] = None   # vLLM's: these tokens' logprobs, not the top ones
    # vLLM's prompt truncation: keep this many prompt tokens (-1: as many as the context allows,
    # leaving one for output), the last ones unless `truncation_side` is "right".
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1, le=_INT64_MAX)
    truncation_side: Optional[Literal["left", "right"]] = None
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: the prompt's in
    # the first chunk, then each chunk's new ids); logprob tokens as "token_id:<id>".
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's: the response's id is "<chatcmpl|cmpl>-<request_id>" (an `X-Request-Id` header wins),
    # for tracing a call through proxies; the engine keeps ids of its own, so repeats do not clash.
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)
    # vLLM's: lower is scheduled first (and preempted last), ahead of the policy's own order.
    priority: Optional[int] = Field(0, ge=_INT64_MIN, le=_INT64_MAX)
    # vLLM's: KV is shared through the prefix cache only among calls of the same salt.
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Per prompt token its logprob and the top `prompt_logprobs` (vLLM's field; not with `stream`).
    prompt_logprobs: Optional[int] = documented(minimum=0)
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # Workflow identity: the X-Workflow-Id header, else `workflow_id`, else vLLM's `session_id`
    # ("stable session identity shared by related requests"), else OpenAI's `prompt_cache_key`
    # (which "replaces the user field"; coding agents send their conversation's id), else `user`.
    workflow_id: Optional[Union[str, int]] = None
    session_id: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    is_last_step: Optional[bool] = False
    repetition_detection: Optional[RepetitionDetectionRequest] = None
    # vLLM's: tokens per streamed chunk (the first and last chunks go at once); the server's
    # `--stream-interval` is the floor. Ignored without `stream`.
    stream_interval: Optional[int] = Field(None, ge=1, le=_INT64_MAX)
    # vLLM's: an open thought gets at most this many tokens, then its end is written (-1: no bound;
    # needs --reasoning-parser or --reasoning-config).
    thinking_token_budget: Optional[StrictInt] = Field(None, ge=-1, le=_INT64_MAX)
    # vLLM's beam search: `n` beams (engine/beam_search.py); ranked by cumulative logprob over
    # length ** length_penalty.
    use_beam_search: Optional[bool] = False
    length_penalty: Optional[float] = 1.0

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `stream_options.continuous_usage_stats` (with `include_usage`): every chunk carries
        the usage so far."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def structured_outputs_field(self) -> str:
        """The field that asked for structured outputs (for error messages)."""
        fmt = self.response_format
        return "response_format" if fmt is not None and fmt.type != "text" else "structured_outputs"

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The output constraint asked for by `response_format` or `structured_outputs` (not both);
        raises ValueError for a malformed one."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if self.structured_outputs is not None:
                raise ValueError("response_format and structured_outputs cannot be combined")
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.type == "structural_tag":   # StructuredOutputsParams checks it (and refuses "format")
                tag = {"structures": fmt.structures, "triggers": fmt.triggers}
                if fmt.format is not None:
                    tag["format"] = fmt.format
                try:
                    return StructuredOutputsParams(structural_tag=json.dumps(tag))
                except ValueError as e:
                    raise ParamError(str(e), "response_format") from e
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError('response_format of type "json_schema" needs json_schema.schema')
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        so = self.structured_outputs
        if so is None:
            return None
        try:
            return StructuredOutputsParams(**so.model_dump(by_alias=True, exclude_none=True))
        except ValueError as e:
            raise ParamError(str(e), "structured_outputs") from e

    def to_sampling_params(self, max_tokens: int, logprobs: Optional[int],
                           prompt_logprobs: Optional[int] = None) -> SamplingParams:
        """Raises ValueError for out-of-range values (the caller answers 400)."""
        return SamplingParams(
            n=1 if self.n is None else self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop_list,
            stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            structured_outputs=self.structured_outputs_params(),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words or []),
            logprob_token_ids=list(self.logprob_token_ids) if self.logprob_token_ids is not None else None,
            cache_salt=self.cache_salt,
            priority=self.priority or 0,
            repetition_detection=RepetitionDetectionParams(**self.repetition_detection.model_dump())
            if self.repetition_detection is not None else None,
            stream_interval=self.stream_interval if self.stream else STREAM_FINAL_ONLY,
            thinking_token_budget=None if self.thinking_token_budget in (None, -1) else self.thinking_token_budget,
            use_beam_search=bool(self.use_beam_search),
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
        )


class ContentPart(OpenAIRequestModel):
    type: str = documented(..., enum=["text"])
    text: Optional[str] = None




class FunctionDefinition(OpenAIRequestModel):
    name: str = Field(..., pattern=_FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(OpenAIRequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIRequestModel):
    name: str


class NamedToolChoice(OpenAIRequestModel):
    type: Literal["function"]
    function: NamedFunction


class MessageFunctionCall(OpenAIRequestModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class MessageToolCall(OpenAIRequestModel):
    """A call in an assistant message of the history (as the API answered it)."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(OpenAIRequestModel):
    role: str = documented(..., enum=sorted(CHAT_ROLES))
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None     # assistant messages
    tool_call_id: Optional[str] = None                    # tool messages

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in CHAT_ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts_only(
        cls, content: Optional[Union[str, list[ContentPart]]]
    ) -> Optional[Union[str, list[ContentPart]]]:
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise ValueError(f"content part type {part.type!r} is not supported; only 'text'")
                if part.text is None:
                    raise ValueError("a content part of type 'text' needs a 'text' field")
        return content

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: string content, extra fields kept. An
        assistant turn's reasoning, sent back as vLLM's `reasoning` or the older
        `reasoning_content`, is given under both names (templates of thinking models read
        `reasoning_content`)."""
        message = self.model_dump(exclude_none=True)
        message["content"] = self.text
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if self.role == "assistant" and isinstance(reasoning, str):
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


class ChatTemplateInput(OpenAIRequestModel):
    """What the chat template renders, for /v1/chat/completions and /tokenize (vLLM's extras
    `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs` included)."""

    messages: list[ChatMessage] = documented(..., minItems=1)
    tools: Optional[list[ChatTool]] = None
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's: documents for a template that does retrieval-augmented generation (its `documents`
    # variable, as transformers' apply_chat_template passes it); a template without RAG ignores them.
    documents: Optional[list[dict[str, str]]] = None
    add_special_tokens: Optional[bool] = False   # on top of what the template writes
    chat_template: Optional[str] = None   # refused: the served model's template is the only one

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages


class PredictionContent(OpenAIRequestModel):
    """OpenAI's predicted output: text the reply is expected to repeat for the most part."""

    type: Literal["content"]
    content: Union[str, list[ContentPart]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingRequest, ChatTemplateInput):
    max_completion_tokens: Optional[int] = documented(minimum=1)
    # OpenAI's predicted outputs: with speculative decoding on, drafts copy it where the reply follows it.
    prediction: Optional[PredictionContent] = None
    # vLLM's, for thinking models (`--reasoning-parser`): false leaves the reasoning out of the
    # reply; `reasoning_effort` goes to the chat template as that variable (GLM-5.x reads it).
    include_reasoning: Optional[bool] = True
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    # vLLM's: the prompt text the model ran on (the template's output) in the response; streamed,
    # in the first chunk.
    return_prompt_text: Optional[bool] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = documented(minimum=0)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = True
    # vLLM's: the reply's content starts with the final message's when that is the assistant's
    # (the text a `continue_final_message` call continues).
    echo: Optional[bool] = False

    @property
    def requested_max_tokens(self) -> Optional[int]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def echoed_text(self) -> str:
        """What `echo` puts ahead of each choice's content."""
        if not self.echo or not self.messages or self.messages[-1].role != "assistant":
            return ""
        return self.messages[-1].text


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: Optional[int] = documented(minimum=0)  # 0 only with echo: the prompt alone
    echo: Optional[bool] = False
    logprobs: Optional[int] = documented(minimum=0)
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: Optional[bool] = True

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: PromptInput) -> PromptInput:
        if isinstance(prompt, list) and (not prompt or any(p == [] for p in prompt)):
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per prompt: text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class TokenizeCompletionRequest(OpenAIRequestModel):
    """POST /tokenize with a prompt (vLLM's API)."""

    model: Optional[str] = None
    prompt: str
    add_special_tokens: Optional[bool] = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(ChatTemplateInput):
    """POST /tokenize with messages: the prompt a chat completion with them would run on."""

    model: Optional[str] = None
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(OpenAIRequestModel):
    model: Optional[str] = None
    tokens: list[int]


class ResponsesFunctionTool(FunctionDefinition):
    """A Responses API tool: a function definition with its type beside it (only functions:
    OpenAI's hosted tools need OpenAI)."""

    type: Literal["function"]


class ResponsesNamedFunction(OpenAIRequestModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(OpenAIRequestModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponsesTextConfig(OpenAIRequestModel):
    format: Optional[ResponsesTextFormat] = None


class ResponsesRequest(OpenAIRequestModel):
    """POST /v1/responses (OpenAI's Responses API, text and function tools). Other fields are
    passed on as they would be on a chat completion (vLLM's sampling extensions, `seed`, ...)."""

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: Optional[bool] = True
    stream: Optional[bool] = False
    max_output_tokens: Optional[int] = documented(minimum=1)
    temperature: Optional[float] = documented(minimum=0)
    top_p: Optional[float] = documented(exclusiveMinimum=0, maximum=1)
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedFunction]] = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[ResponsesTextConfig] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    background: Optional[bool] = False
    include: Optional[list[str]] = None
    reasoning: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = None
    max_tool_calls: Optional[int] = documented(minimum=1)
    workflow_id: Optional[Union[str, int]] = None
    session_id: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    is_last_step: Optional[bool] = False


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """OpenAI's, for a call with a predicted output: its tokens accepted as drafts, and the rest."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @classmethod
    def of(cls, samples: Iterable[Any]) -> Optional["CompletionTokensDetails"]:
        """Summed over the choices' latest outputs; None where the call had no prediction."""
        with_prediction = [s for s in samples if s.accepted_prediction_tokens is not None]
        if not with_prediction:
            return None
        return cls(accepted_prediction_tokens=sum(s.accepted_prediction_tokens for s in with_prediction),
                   rejected_prediction_tokens=sum(s.rejected_prediction_tokens for s in with_prediction))


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: Optional[CompletionTokensDetails] = None   # left out when None

    @model_serializer(mode="wrap")
    def _drop_empty_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("completion_tokens_details") is None:
            out.pop("completion_tokens_details", None)
        return out

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
           details: Optional[CompletionTokensDetails] = None) -> "UsageInfo":
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            completion_tokens_details=details,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                       # a JSON object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def _is_none(value: Any) -> bool:
    return value is None


def _omitted_when_none() -> Any:
    """A field of vLLM's that a response carries only when it has a value (`token_ids`,
    `prompt_token_ids` and `prompt_text` when asked for, `reasoning` when there was one), while the
    OpenAI fields beside it keep their nulls."""
    return Field(None, exclude_if=_is_none)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # vLLM's: a thinking model's reasoning (`--reasoning-parser`); absent without it.
    reasoning: Optional[str] = _omitted_when_none()


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = _omitted_when_none()


class PromptLogprob(BaseModel):
    """One token of a prompt-logprob entry, as vLLM writes it."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per prompt token: None for the first, else {token id: its logprob}, the token itself and the top ones.
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None
    prompt_token_ids: Optional[list[int]] = _omitted_when_none()
    prompt_text: Optional[str] = _omitted_when_none()     # vLLM's return_prompt_text


class _DropNone(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: Optional[str] = None           # only in a call's first chunk
    arguments: str


class DeltaToolCall(_DropNone):
    """A call's chunk. A call parsed from text (hermes, or tool_choice "required") comes whole
    in one chunk; a named tool_choice streams its arguments: id, type and name in the first
    chunk, then argument fragments alone."""

    index: int                           # the call's position in the message
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class DeltaMessage(_DropNone):
    """Only the fields a chunk carries: `{"role": "assistant", "content": ""}`, `{"content": "..."}`,
    `{"tool_calls": [...]}` or `{}` (the chunk with the finish reason)."""

    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = _omitted_when_none()


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = _omitted_when_none()
    prompt_text: Optional[str] = _omitted_when_none()     # vLLM's return_prompt_text (first chunk)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_token_ids: Optional[list[int]] = _omitted_when_none()   # (vLLM puts the prompt's ids in the choice)
    token_ids: Optional[list[int]] = _omitted_when_none()


class CompletionResponseChoice(CompletionChoice):
    """A choice of a whole (not streamed) response: vLLM's `prompt_logprobs` may ride along."""

    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[Union[CompletionResponseChoice, CompletionChoice]]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "sluice"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadInfo(BaseModel):
    running: int
    waiting: int
    waiting_tokens: int
    kv_usage: float
    accepting: bool
    # How many new workflows are welcome now (0 unless accepting). A router admitting on this
    # should count its own admissions whose calls have not reached the server yet against it.
    admissible_workflows: int
    # Workflows in flight, and the bound `admissible_workflows` keeps on them (null: none).
    active_workflows: int = 0
    max_active_workflows: Optional[int] = None
    # With `?pending=`: how many of those workflow ids the server counts already (among
    # `active_workflows`, so in `admissible_workflows`); the caller's room is
    # admissible_workflows - (pending ids - pending_counted).
    pending_counted: Optional[int] = None
