"""Per-request sampling parameters, with OpenAI semantics and the usual engine extensions."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

_MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = _MAX_LOGPROBS // 2   # each step asks for every beam's 2n most likely next tokens
MAX_CACHE_SALT_CHARS = 1024   # vLLM's OpenAI schema bound
MAX_LOGPROB_TOKEN_IDS = 128   # each costs a pass over the vocabulary per output position
# A stream interval no output reaches: only a request's first output and its last (the server's
# non-streamed calls, which read only the end, skip building an output per step).
STREAM_FINAL_ONLY = 1 << 62


class ParamError(ValueError):
    """A ValueError that names the request field at fault (the server's 400 carries it as `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's `structured_outputs`): exactly one of
    a JSON schema, any JSON object, a regular expression, a choice of strings, a grammar (Lark
    or GBNF), or structural tags. The engine turns it into a token mask at every step
    (engine/structured_output.py)."""

    json: Optional[Union[str, dict[str, Any]]] = None   # a JSON schema (an object or its text)
    json_object: bool = False                          # any JSON object
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None                       # Lark or GBNF (llama.cpp's grammar format)
    disable_any_whitespace: bool = False                # JSON: compact, no whitespace between tokens
    disable_additional_properties: bool = False         # JSON: objects without the keyword get false
    whitespace_pattern: Optional[str] = None            # JSON: a regex for the whitespace allowed
    # vLLM's structural tags (the JSON text of {"structures": [{"begin", "schema", "end"}, ...],
    # "triggers": [...]}): free text, except that once the output writes a trigger it goes on with
    # the begin string of a structure whose begin starts with it, JSON of that structure's schema,
    # and its end string, then free text again (a tool call inside a reply).
    structural_tag: Optional[str] = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.structural_tag, dict):
            object.__setattr__(self, "structural_tag", json.dumps(self.structural_tag))
        set_ = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, "
                             f"grammar and structural_tag; got {set_ or 'none'}")
        if self.structural_tag is not None:
            self.structural_tags()   # raises for a malformed one
        json_options = [k for k in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
                        if getattr(self, k) not in (False, None)]
        if json_options and self.kind not in ("json", "json_object"):
            raise ValueError(f"structured outputs: {', '.join(json_options)} apply to json and json_object only")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError("structured outputs: disable_any_whitespace and whitespace_pattern contradict each other")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured outputs: json is not a valid JSON schema text: {e}") from e
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured outputs: a JSON schema must be an object")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured outputs: a JSON schema must be an object")

    def schema(self) -> Any:
        """json and json_object: the JSON schema to compile, with the options applied: whitespace
        ones told to llguidance in its `x-guidance` options (unless the schema sets them itself),
        disable_additional_properties written into every object schema that does not say."""
        schema = {"type": "object"} if self.json_object else self.json
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            return schema
        if self.disable_additional_properties:
            schema = _closed_objects(schema)
        guidance = {}
        if self.disable_any_whitespace:
            guidance["whitespace_flexible"] = False
        if self.whitespace_pattern is not None:
            guidance["whitespace_pattern"] = self.whitespace_pattern
        if guidance:
            schema = {**schema, "x-guidance": {**guidance, **schema.get("x-guidance", {})}}
        return schema

    def structural_tags(self) -> tuple[list[tuple[str, str, Any, str]], list[str]]:
        """structural_tag as ([(trigger, begin, schema, end)], triggers); ValueError if malformed.
        The trigger of a structure is the first trigger its begin string starts with (vLLM's rule)."""
        try:
            spec = json.loads(self.structural_tag)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"structured outputs: structural_tag is not valid JSON text: {e}") from e
        if isinstance(spec, dict) and "format" in spec:
            raise ValueError('structured outputs: the structural_tag form with "format" (xgrammar\'s) is not '
                             'supported; give "structures" and "triggers"')
        if not isinstance(spec, dict) or set(spec) - {"type", "structures", "triggers"}:
            raise ValueError('structured outputs: structural_tag takes "structures" and "triggers"')
        triggers, structures = spec.get("triggers"), spec.get("structures")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError("structured outputs: structural_tag triggers must be a non-empty list of non-empty strings")
        if not isinstance(structures, list) or not structures:
            raise ValueError("structured outputs: structural_tag structures must be a non-empty list")
        tags = []
        for s in structures:
            if (not isinstance(s, dict) or set(s) != {"begin", "schema", "end"} or not isinstance(s["begin"], str)
                    or not isinstance(s["end"], str) or not isinstance(s["schema"], dict)):
                raise ValueError('structured outputs: each structural_tag structure is {"begin": text, '
                                 '"schema": a JSON schema, "end": text}')
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structured outputs: structural_tag begin {s['begin']!r} starts with none of "
                                 f"the triggers {triggers}")
            tags.append((trigger, s["begin"], s["schema"], s["end"]))
        return tags, triggers

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None)

    def key(self) -> tuple[str, str]:
        """A canonical identity, for caching compiled grammars."""
        if self.kind in ("json", "json_object"):
            return self.kind, json.dumps(self.schema(), sort_keys=True, separators=(",", ":"))
        if self.kind == "structural_tag":
            tags, triggers = self.structural_tags()
            return self.kind, json.dumps([tags, triggers], sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return "choice", json.dumps(list(self.choice))
        return self.kind, getattr(self, self.kind)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def _closed_objects(schema: Any) -> Any:
    """A copy of a JSON schema in which every object schema (one with "properties" or type
    "object") that does not say otherwise has "additionalProperties": false. Only subschemas are
    visited (not `enum`, `const`, `default` or other data)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), list):         # the old array form of items
            out[key] = [_closed_objects(sub) for sub in out[key]]
        elif key in out:
            out[key] = _closed_objects(out[key])
    kind = out.get("type")
    if ("properties" in out or kind == "object" or (isinstance(kind, list) and "object" in kind)) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """vLLM's `repetition_detection`: generation ends (finish reason "repetition") once the output
    ends with a pattern of `min_pattern_size` to `max_pattern_size` tokens repeated `min_count`
    times in a row, e.g. "abcabcabc" for pattern 3 and count 3 (a model stuck in a loop, which
    would otherwise run to max_tokens). `max_pattern_size` 0 turns it off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0       # 0: 1
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"repetition_detection.{name} must be an integer")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must be >= 0, with "
                             "min_pattern_size <= max_pattern_size (both 0 turns detection off)")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("repetition_detection.min_count must be at least 2 (or max_pattern_size 0 to "
                             "turn detection off)")

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    def repeats(self, tokens: list[int]) -> bool:
        """Whether `tokens` ends with some pattern of an allowed size repeated `min_count` times:
        its last min_count * L tokens are L-periodic. Candidate periods are where the last token
        occurred before (found by `list.index`, at C speed); each is checked at the other
        repetitions' last tokens before one slice comparison settles it."""
        if not self.enabled:
            return False
        n, count = len(tokens), self.min_count
        lo = max(1, self.min_pattern_size)
        hi = min(self.max_pattern_size, n // count)
        if hi < lo:
            return False
        last = tokens[-1]
        j = n - 1 - hi                          # period L = n - 1 - j, from hi down to lo
        stop = n - lo                           # exclusive bound of j
        while True:
            try:
                j = tokens.index(last, j, stop)
            except ValueError:
                return False
            period = n - 1 - j
            if all(tokens[n - 1 - k * period] == last for k in range(2, count)) \
                    and tokens[n - count * period:n - period] == tokens[n - (count - 1) * period:]:
                return True
            j += 1


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: Optional[int] = 16  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top logprobs per output token (0: only the chosen)
    # vLLM's: the logprobs of these tokens at every output position, in place of the top ones
    # (a classifier's labels, say); needs `logprobs`.
    logprob_token_ids: Optional[list[int]] = None
    # Per prompt token after the first: its logprob under the prompt before it, plus the top
    # `prompt_logprobs` (vLLM's field; the completions API's `echo` with `logprobs` uses it). Such a
    # request computes its whole prompt: prefix-cache hits would leave positions without logits.
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: Optional[StructuredOutputsParams] = None
    logit_bias: Optional[dict[int, float]] = None     # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Optional[list[int]] = None     # sample only among these ids
    # Words the output must not contain (vLLM's field; the engine bans their token sequences, as
    # vLLM does: sluice/engine/bad_words.py).
    bad_words: list[str] = field(default_factory=list)
    # vLLM's `cache_salt`: the request's KV is shared through the prefix cache (and a workflow's
    # retention) only with requests of the same salt, so a tenant cannot learn from cache hits
    # what another sent. Salting starts the chain of block hashes (block_pool.salted_root).
    cache_salt: Optional[str] = None
    # vLLM's request `priority`: lower is served first, ahead of every other rule of the scheduling
    # policy, and preempted last (vLLM needs `--scheduling-policy priority`; both of sluice's
    # policies honour it). The default 0 leaves the policy's order as it is.
    priority: int = 0
    # vLLM's: end generation once the output repeats a pattern (RepetitionDetectionParams).
    repetition_detection: Optional[RepetitionDetectionParams] = None
    # vLLM's: a streamed request's outputs carry at least this many new tokens each (the first and
    # the last go out at once); the engine's `stream_interval` is the floor. None: the engine's.
    stream_interval: Optional[int] = None
    # vLLM's: an open thought gets at most this many tokens, then the engine writes its end
    # (engine/thinking.py); needs an engine that knows the model's thinking tags. None: no bound.
    thinking_token_budget: Optional[int] = None
    # vLLM's beam search (`use_beam_search`): `n` beams; every step extends each beam by its 2n most
    # likely next tokens and keeps the n best by cumulative logprob; the n best beams are the output,
    # ranked by cumulative logprob over length ** length_penalty (engine/beam_search.py). It is
    # deterministic: the sampling fields are not used.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # OpenAI's predicted outputs, as token ids: what the client expects the reply to be (mostly);
    # with speculative decoding on, drafts copy it where the output follows it (spec_decode.py).
    # The output does not change, only how many steps it takes.
    prediction: Optional[list[int]] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for out-of-range values."""
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (disabled) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be positive")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {tok!r}")
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}]")
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not ids or len(ids) > MAX_LOGPROB_TOKEN_IDS or any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError(f"logprob_token_ids must be 1 to {MAX_LOGPROB_TOKEN_IDS} token ids")
            if self.logprobs is None:
                raise ValueError("logprob_token_ids needs logprobs")
        if self.stream_interval is not None and (isinstance(self.stream_interval, bool)
                                                 or not isinstance(self.stream_interval, int)
                                                 or self.stream_interval < 1):
            raise ValueError("stream_interval must be a positive integer")
        if self.thinking_token_budget is not None and (isinstance(self.thinking_token_budget, bool)
                                                       or not isinstance(self.thinking_token_budget, int)
                                                       or self.thinking_token_budget < 0):
            raise ValueError("thinking_token_budget must be a non-negative integer")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}]")
        if self.prediction is not None and any(not isinstance(t, int) or t < 0 for t in self.prediction):
            raise ValueError("prediction must be token ids")
        if not math.isfinite(self.length_penalty):
            raise ValueError("length_penalty must be a finite number")
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """Beam search ranks beams by the model's own logprobs: what would change the distribution
        or cut a beam by its text is refused rather than silently ignored."""
        if self.n > MAX_BEAM_WIDTH:
            raise ParamError(f"beam search takes n (the beam width) up to {MAX_BEAM_WIDTH}", "n")
        unsupported = {
            "stop": bool(self.stop), "bad_words": bool(self.bad_words),
            "structured_outputs": self.structured_outputs is not None, "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0, "logprob_token_ids": self.logprob_token_ids is not None,
            "repetition_detection": self.repetition_detection is not None,
            "thinking_token_budget": self.thinking_token_budget is not None, "prediction": bool(self.prediction),
        }
        for name, used in unsupported.items():
            if used:
                raise ParamError(f"{name} is not supported with beam search", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
