"""Frozen configuration shared by the engine, the model runner and the server.

The CLI builds these once; nothing deeper in the engine reads environment variables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer, read from config.json or GGUF metadata."""

    architecture: str                 # e.g. "LlamaForCausalLM"
    model_type: str                   # e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Optional[dict] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # Everything else config.json carried, for architectures that need more fields.
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16              # tokens per KV block
    num_blocks: int = 0               # 0: derive from kv_cache_tokens / kv_cache_gib
    kv_cache_tokens: Optional[int] = None
    kv_cache_gib: Optional[float] = None
    enable_prefix_caching: bool = True
    # Hybrid models: recurrent-state snapshots kept for the prefix cache (None: a default bound,
    # see engine/cache_plan.py; 0: none, so such a model gets no prefix-cache hits).
    max_state_snapshots: Optional[int] = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.max_state_snapshots is not None and self.max_state_snapshots < 0:
            raise ValueError("max_state_snapshots must be >= 0")
        if self.kv_cache_tokens is not None and self.kv_cache_gib is not None:
            raise ValueError("give at most one of kv_cache_tokens and kv_cache_gib")

    def resolve_num_blocks(self, bytes_per_token: int) -> int:
        """Number of KV blocks given the per-token KV footprint of the model (all layers)."""
        if self.num_blocks:
            return self.num_blocks
        if self.kv_cache_tokens is not None:
            return max(1, -(-self.kv_cache_tokens // self.block_size))
        gib = self.kv_cache_gib if self.kv_cache_gib is not None else 1.0
        return max(1, int(gib * (1 << 30)) // (bytes_per_token * self.block_size))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64                 # most requests in one step
    max_num_batched_tokens: int = 512      # token budget of one step (decodes + prefill chunks)
    max_model_len: int = 8192              # prompt + output tokens of one request
    policy: str = "workflow"               # name in the scheduling-policy registry
    max_waiting_requests: Optional[int] = None   # admission bound (None: unbounded)
    max_waiting_tokens: Optional[int] = None     # admission bound on queued prompt tokens
    retention_ttl_s: float = 10.0          # KV retention of a finished workflow call
    aging_s: float = 5.0                   # waiting time that promotes a request by one level
    # Under KV pressure, a call waiting this long goes before all others (None: 10 x aging_s).
    starvation_s: Optional[float] = None
    # `GET /load` welcomes no new workflow while this many steps' token budgets of prompt tokens
    # wait to be computed (None: no such bound). See Scheduler.admissible_workflows.
    admit_backlog_steps: Optional[float] = 2.0
    # `GET /load` welcomes no new workflow while this many are in flight: a call running or
    # waiting, or KV retained for its next call ("auto": the fewest that keep the engine busy,
    # found as it runs, see engine/admission.py; None: no such bound). See
    # Scheduler.admissible_workflows.
    max_active_workflows: Optional[Union[int, str]] = "auto"
    # With "auto": the band of engine overhead (fixed step cost and idle time, a share of the
    # wall clock) the bound steers into; lower keeps more workflows in flight. None: the
    # controller's default (WorkflowLimit.OVERHEAD_LOW, OVERHEAD_HIGH).
    auto_overhead_band: Optional[tuple[float, float]] = None
    # With "auto": a cap on the bound, (low, high) of a step's mean length over what the mean
    # call's own prompt costs: the bound rises only while the ratio is under low and falls while
    # it is over high, whatever the overhead (None: no cap). See engine/admission.py.
    auto_step_ratio: Optional[tuple[float, float]] = (0.8, 1.0)
    # While prompt tokens wait, running decodes sit out up to this many consecutive steps, so
    # the prompts get those steps alone and their first tokens come one decode pass sooner
    # (0: every step carries every running decode first). See Scheduler.schedule.
    decode_yield_steps: int = 1
    # Once a step holds this many tokens, the first prompt it completes closes it to further
    # prompt chunks, so that call's first token does not wait for work that only starts there
    # (None: prompt chunks fill the token budget). See Scheduler.schedule.
    close_step_tokens: Optional[int] = 128

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_model_len <= 0:
            raise ValueError("scheduler limits must be positive")
        if self.admit_backlog_steps is not None and self.admit_backlog_steps <= 0:
            raise ValueError("admit_backlog_steps must be positive (or None for no bound)")
        m = self.max_active_workflows
        if m is not None and m != "auto" and (not isinstance(m, int) or m <= 0):
            raise ValueError('max_active_workflows must be a positive integer, "auto", or None for no bound')
        band = self.auto_overhead_band
        if band is not None and not (len(band) == 2 and 0.0 < band[0] < band[1] < 1.0):
            raise ValueError("auto_overhead_band must be (low, high) with 0 < low < high < 1")
        if band is not None and m != "auto":
            raise ValueError('auto_overhead_band steers max_active_workflows="auto" and means nothing with a fixed or no bound')
        ratio = self.auto_step_ratio
        if ratio is not None and not (len(ratio) == 2 and 0.0 < ratio[0] < ratio[1]):
            raise ValueError("auto_step_ratio must be (low, high) with 0 < low < high, or None")
        if self.decode_yield_steps < 0:
            raise ValueError("decode_yield_steps must be >= 0")
        if self.close_step_tokens is not None and self.close_step_tokens < 0:
            raise ValueError("close_step_tokens must be >= 0 (or None: prompts fill the budget)")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup (n-gram) speculative decoding (see engine/spec_decode.py).

    Each step, a decoding request whose last `prompt_lookup_max` .. `prompt_lookup_min` tokens
    occurred earlier in its context drafts up to `num_speculative_tokens` tokens by copying what
    followed there; one forward pass verifies them. Output is distributed exactly as without it
    (greedy: the same tokens, up to floating-point differences between batch shapes).

    `adaptive` (sluice's key; vLLM's ngram drafts a fixed length): each request drafts up to a
    length of its own, from 6, longer after verifications that accept every draft and shorter
    after ones that do not, up to `num_speculative_tokens` (engine/scheduler.py, START_DRAFTS).
    """

    method: str = "ngram"
    # With `adaptive`, the most drafts one verification takes (session 46: up to 16, against a
    # fixed 6, +7% throughput at +3% TTFT p50); without, the length of every draft (a fixed 6 was
    # the best of 4/6/8 on agent traffic in session 9).
    num_speculative_tokens: int = 16
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 3
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"unsupported speculative method {self.method!r}; sluice has 'ngram'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16")
        if not isinstance(self.adaptive, bool):
            raise ValueError("adaptive must be true or false")

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        """vLLM's `--speculative-config` keys, and sluice's `adaptive`; unknown keys are an error."""
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative config keys {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
            d["prompt_lookup_min"] = min(cls.prompt_lookup_min, d["prompt_lookup_max"])
        if "prompt_lookup_min" in d and "prompt_lookup_max" not in d:
            d["prompt_lookup_max"] = max(cls.prompt_lookup_max, d["prompt_lookup_min"])
        return cls(**d)


# How a checkpoint's weights sit in memory (EngineConfig.weight_format, `--weight-format`).
WEIGHT_FORMATS = ("auto", "native", "bf16")


@dataclass(frozen=True)
class ReasoningConfig:
    """How a thinking model's thought opens and closes, for `thinking_token_budget` and for where a
    constrained reply's grammar starts (vLLM's `--reasoning-config`; `--reasoning-parser` sets the
    parsers' `<think>` / `</think>`).
    `forced_end` (vLLM's `reasoning_end_str`) is what the engine writes when a thought reaches its
    budget: the end tag, or a transition phrase ending with it; None: the end tag."""

    start: str = "<think>"
    end: str = "</think>"
    forced_end: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.start or not self.end or self.forced_end == "":
            raise ValueError("the reasoning start and end strings must not be empty")

    @classmethod
    def from_dict(cls, d: dict) -> "ReasoningConfig":
        """vLLM's `--reasoning-config` keys: reasoning_start_str, reasoning_end_str (the forced end;
        without a reasoning parser it is the natural end too); reasoning_parser is the flag's."""
        unknown = sorted(set(d) - {"reasoning_start_str", "reasoning_end_str", "reasoning_parser"})
        if unknown:
            raise ValueError(f"unknown reasoning config keys: {', '.join(unknown)}")
        for key in ("reasoning_start_str", "reasoning_end_str"):
            if key in d and not isinstance(d[key], str):
                raise ValueError(f"{key} must be a string")
        start, forced = d.get("reasoning_start_str"), d.get("reasoning_end_str")
        if d.get("reasoning_parser") is None and (start is None or forced is None):
            raise ValueError("without --reasoning-parser the reasoning config needs both reasoning_start_str "
                             "and reasoning_end_str")
        if d.get("reasoning_parser") is None:
            return cls(start=start, end=forced)
        return cls(start=start or cls.start, forced_end=forced)

    @property
    def forced(self) -> str:
        return self.forced_end if self.forced_end is not None else self.end


def reasoning_tags(parser: Optional[str], overrides: Optional[dict] = None) -> Optional[ReasoningConfig]:
    """The engine's thinking tags for `--reasoning-parser` and `--reasoning-config` (a dict), or
    None when neither is given. Every parser sluice has thinks between `<think>` and `</think>`."""
    if parser is not None and parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; choose from {list(REASONING_PARSERS)}")
    if overrides is None:
        return ReasoningConfig() if parser is not None else None
    return ReasoningConfig.from_dict({**overrides, "reasoning_parser": parser or overrides.get("reasoning_parser")})


def check_weight_format(fmt: str) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, not {fmt!r}")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    attention_backend: str = "auto"       # "cpu" also runs bf16 linear layers on the compiled kernel
    num_threads: Optional[int] = None
    # Weights and KV cache on transparent huge pages where the kernel offers them (sluice/hugepages.py).
    huge_pages: bool = True
    # One of WEIGHT_FORMATS. "native": a GGUF file's Q4_1 / Q8_0 weights of linear layers stay in
    # its blocks in memory, which the CPU kernels dequantize as they compute (the same bf16
    # weights, bit for bit); "bf16": dequantized at load; "auto": native where the linears run on
    # AMX tiles, bf16 elsewhere (model/loader.py: keeps_blocks).
    weight_format: str = "auto"
    step_trace_path: Optional[str] = None  # append one JSON line per engine step (shape and timings)
    speculative: Optional[SpeculativeConfig] = None  # None: no speculative decoding
    # Steps that schedule nothing while requests are unfinished, for this long, end those requests
    # with an error instead of leaving them waiting forever (a scheduler fault; see LLMEngine.step).
    stall_timeout_s: float = 30.0
    # vLLM's `--stream-interval`: a request's outputs carry at least this many new tokens each,
    # save its first and its last (fewer, larger stream chunks: less work per token for the
    # server and the client); a request's own `stream_interval` may raise it.
    stream_interval: int = 1
    # vLLM's `--chat-template`: this Jinja template in place of the model's own (the text; the CLI
    # reads a file path into it).
    chat_template: Optional[str] = None
    # A thinking model's tags (a reasoning parser or --reasoning-config): requests may then set
    # `thinking_token_budget`, and a constrained reply's grammar starts after its thought
    # (engine/thinking.py). None: neither.
    reasoning: Optional[ReasoningConfig] = None

    def __post_init__(self) -> None:
        check_weight_format(self.weight_format)
        if self.stream_interval < 1:
            raise ValueError("the stream interval must be at least 1")
        if not self.stall_timeout_s > 0:
            raise ValueError("the stall timeout must be a positive number of seconds")


TOOL_PARSERS = ("hermes", "glm45", "glm47", "qwen3_coder", "qwen3_xml")   # the tool-call formats sluice parses (sluice/server/tool_calls.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "glm45", "glm47")   # <think> ... </think> (sluice/server/reasoning.py)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    metrics_require_auth: bool = False
    max_request_bytes: int = 8 << 20
    max_n: int = 16                       # bound on `n`
    max_stop_strings: int = 16
    max_logprobs: int = 20
    shutdown_timeout_s: float = 30.0      # SIGTERM: how long in-flight calls may run before the exit
    log_requests: bool = False
    enable_auto_tool_choice: bool = False  # parse tool calls out of replies (tool_choice "auto")
    tool_call_parser: Optional[str] = None  # the model's tool-call format: one of TOOL_PARSERS
    reasoning_parser: Optional[str] = None  # one of REASONING_PARSERS: a reply's <think> text is its reasoning
    # vLLM's `--default-chat-template-kwargs`: template variables every chat gets unless its own
    # `chat_template_kwargs` sets them (e.g. {"enable_thinking": false} for a thinking model).
    default_chat_template_kwargs: Optional[dict] = None
    responses_store_size: int = 1024      # stored /v1/responses (previous_response_id), LRU; 0: none
    fault_inject_after_steps: Optional[int] = None  # tests only: the engine loop fails after N busy steps
    fault_inject_stall_after_steps: Optional[int] = None  # tests only: the scheduler stalls after N busy steps

    def __post_init__(self) -> None:
        if self.max_request_bytes <= 0 or self.max_n < 1 or self.max_stop_strings < 0 or self.max_logprobs < 0:
            raise ValueError("server bounds must be positive")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must be >= 0")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r}; choose from {list(TOOL_PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r}; choose from {list(REASONING_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
