"""What the engine hands back to its callers (offline API and server)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int = 0                      # 1-based rank in the distribution; 0 if unknown


@dataclass
class CompletionOutput:
    index: int                         # which of the request's n samples
    text: str                          # full text so far (stop strings removed)
    token_ids: list[int]               # all output token ids so far
    cumulative_logprob: Optional[float] = None
    # One entry per output token: the sampled token's logprob plus the top ones.
    logprobs: Optional[list[dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "repetition", "abort", "error"; None while running
    stop_reason: Optional[int | str] = None
    text_delta: str = ""               # text added since the previous output of this sample
    num_new_tokens: int = 0            # token ids added since the previous output of this sample
    # With a predicted output (SamplingParams.prediction): its tokens accepted as drafts, and the
    # rest of its tokens (OpenAI's usage.completion_tokens_details); None without one.
    accepted_prediction_tokens: Optional[int] = None
    rejected_prediction_tokens: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0         # prompt tokens served from the prefix cache
    error: Optional[str] = None        # set when finish_reason is "error"
    metrics: dict = field(default_factory=dict)  # arrival/first-token/finish times (monotonic s)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else its {token:
    # Logprob} (the token itself plus the top ones); set once the whole prompt has been computed.
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    # When (engine clock) each step whose tokens this output carries ran: one time per output at
    # stream interval 1; several where outputs were coalesced (stream_interval, non-streamed calls).
    token_times: list[float] = field(default_factory=list)
