"""Structured outputs: the token masks that keep a request's output inside a language.

A request's `StructuredOutputsParams` (a JSON schema, any JSON object, a regular expression, a
choice of strings, or a Lark/GBNF grammar) is compiled once into an llguidance grammar (the
library behind vLLM's "guidance" backend; it works on the tokenizer's own vocabulary, so a mask
allows exactly the tokens whose bytes keep the output a prefix of the language). Each sequence then
carries a `GrammarState`, a matcher that advances with every token appended to its output
(`Request.append_output_token`), and the runner asks it for one bitmask per sampled position:

- plain decoding: one mask, from the current state;
- verifying speculative drafts: drafts are first cut to the longest prefix the grammar accepts
  (`valid_prefix`, in the proposer), then position i's mask is the state after drafts[:i]
  (consumed, masked, rolled back), so each sampled token obeys the grammar given exactly the
  tokens before it, as in plain decoding, and greedy outputs are the same with or without drafts.

The grammar decides where the output ends: once it is complete only an end-of-sequence token is
allowed, and a matcher that has consumed it (or can take nothing more) finishes the request with
"stop". `min_tokens` holds the end back only where the grammar allows something else. Compiled
grammars are cached by their canonical text (agent traffic sends the same schema with every
call), and compiling a new one is done by the server in a worker thread before the
request reaches the engine, so a large schema never stalls the engine's step loop.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from sluice.sampling_params import StructuredOutputsParams

_BITS = torch.arange(32, dtype=torch.int32)


def mask_words(vocab_size: int) -> int:
    """int32 words in one token bitmask (bit t % 32 of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmasks [R, W] int32 -> allowed [R, vocab_size] bool."""
    bits = (masks.unsqueeze(-1) >> _BITS) & 1          # [R, W, 32]
    return bits.view(masks.shape[0], -1)[:, :vocab_size].bool()


def leaves_a_token(mask: torch.Tensor, banned: Sequence[int]) -> bool:
    """Whether bitmask [W] allows some token outside `banned` (min_tokens' suppressed end tokens)."""
    words = mask.numpy().view(np.uint32).copy()
    for t in banned:
        if 0 <= t < 32 * len(words):
            words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(words.any())


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor) -> None:
    """Set disallowed tokens' logits [R, V] to -inf, in place; masks [R, W] int32."""
    logits.masked_fill_(~allowed_tokens(masks, logits.shape[1]), float("-inf"))


def allow_token(mask: torch.Tensor, token_id: int) -> torch.Tensor:
    """A copy of bitmask `mask` [W] int32 that also allows `token_id`."""
    out = mask.clone()
    bit = 1 << (token_id % 32)
    out[token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit
    return out


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher", "_words")

    def __init__(self, matcher, words: int) -> None:
        self._matcher = matcher
        self._words = words

    @property
    def is_stopped(self) -> bool:
        """The output is complete: nothing more may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> Optional[str]:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def consume(self, token_id: int) -> bool:
        """Advance by one output token; False if the grammar does not allow it (the matcher is then
        in error and stays there)."""
        return self._matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar accepts from here (the state does not move)."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def masks(self, drafts: Sequence[int] = ()) -> torch.Tensor:
        """[1 + len(drafts), W] int32: the mask now and after each prefix of `drafts`, which must
        all be accepted (see `valid_prefix`). Past a draft that completes the output the rows
        repeat the complete output's mask: the sequence stops at that draft, and the matcher takes
        an end token there without counting it, so consuming it would make the rollback undo one
        of the sequence's own tokens."""
        out = torch.empty((len(drafts) + 1, self._words), dtype=torch.int32)
        consumed = 0
        try:
            for i in range(len(drafts) + 1):
                row = out[i]
                self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)
                if i < len(drafts):
                    if self._matcher.is_stopped():
                        out[i + 1:] = row
                        break
                    if not self._matcher.consume_token(drafts[i]):
                        raise RuntimeError(f"draft token {drafts[i]} is not allowed by the grammar")
                    consumed += 1
        finally:
            self.rollback(consumed)
        return out


class CompiledGrammar:
    """A grammar ready to start sequences (a matcher in its initial state, copied per sequence)."""

    def __init__(self, matcher, words: int) -> None:
        self._template = matcher
        self._words = words

    def new_state(self) -> GrammarState:
        return GrammarState(self._template.deep_copy(), self._words)


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` for one tokenizer and vocabulary; thread-safe, cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._lltokenizer = None   # built on first use (~0.3 s for a 49k vocabulary)

    def _tokenizer(self):
        import llguidance

        with self._lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._lltokenizer

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Raises ValueError with a user-facing message when the spec is not a valid grammar."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance

        text = grammar_text(spec)
        matcher = llguidance.LLMatcher(self._tokenizer(), text)
        if matcher.is_error():
            raise ValueError(f"invalid {_WHAT[spec.kind]}: {_first_line(matcher.get_error())}")
        return CompiledGrammar(matcher, mask_words(self.vocab_size))


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
         "choice": "choice", "grammar": "grammar", "structural_tag": "structural tag"}


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3]) if lines else message


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec (raises ValueError for what cannot be translated)."""
    import llguidance

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.schema()))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        if kind == "structural_tag":
            # The schema goes in as a JSON schema. (vLLM's guidance backend passes it compiled, as
            # grammar text, which llguidance then reads as a schema of unknown keywords: any JSON;
            # vLLM's default backend for structural tags, xgrammar, enforces the schema, as here.)
            tags, _ = spec.structural_tags()
            return llguidance.StructTag.to_grammar([
                llguidance.StructTag(trigger=trigger, begin=begin, end=end, grammar=schema)
                for trigger, begin, schema, end in tags])
        return llguidance.grammar_from("grammar", spec.grammar)   # Lark, or GBNF converted to it
    except Exception as e:   # ValueError, or whatever the grammar converters' parsers raise
        raise ValueError(f"invalid {_WHAT[kind]}: {_first_line(str(e))}") from e
