"""Prompt-lookup (n-gram) speculative decoding: drafting and verification.

Drafting. A request keeps an index of the n-grams of its own token sequence (prompt and output,
n in [prompt_lookup_min, prompt_lookup_max]) mapping each to the position after its most recent
occurrence. The draft for the next step copies what followed the most recent earlier occurrence
of the sequence's current suffix, longest n first. The copy may run past the end of the known
tokens into the draft itself (an LZ77-style copy), so a loop of period p drafts a full
`num_speculative_tokens` instead of p tokens. The index grows by a constant amount of work per
token, so drafting costs no scan of the context.

Verification (`accept`). The request's last token and its k drafts are one query of k + 1 tokens;
position i's logits are sampled as if drafts[:i] had been generated (penalties and min_tokens
suppression see them). Draft i is accepted while it equals the token sampled at position i;
the step yields the accepted drafts plus the token sampled at the first mismatch (or after the
last draft). Each sampled token is drawn from the model's distribution given exactly the
tokens before it, so the output has the distribution of plain decoding: for greedy rows the
same tokens, for random rows the same law (an accepted draft is a sample that happened to
equal it; with a one-hot draft this is standard speculative sampling's rule).
"""
from __future__ import annotations

from typing import Sequence

from sluice.config import SpeculativeConfig


class NgramIndex:
    """n-gram -> position after its most recent occurrence that has a continuation."""

    __slots__ = ("n_min", "n_max", "maps", "done")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.done = 0   # n-grams ending before index `done` are indexed

    def update(self, tokens: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token (so has a continuation)."""
        end = len(tokens) - 1
        for e in range(self.done, end):
            for n, m in self.maps.items():
                if e + 1 >= n:
                    m[tuple(tokens[e + 1 - n:e + 1])] = e + 1
        self.done = max(self.done, end)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts following the current suffix's most recent earlier occurrence."""
        if k <= 0:
            return []
        self.update(tokens)
        size = len(tokens)
        for n in range(self.n_max, self.n_min - 1, -1):
            if size < n + 1:
                continue
            start = self.maps[n].get(tuple(tokens[size - n:]))
            if start is None:
                continue
            drafts: list[int] = []
            for j in range(k):
                i = start + j
                drafts.append(tokens[i] if i < size else drafts[i - size])
            return drafts
        return []


class PredictedOutput:
    """OpenAI's predicted outputs: a client's guess at the reply (a file it expects back with a few
    edits, say), drafted where the output follows it. The output is aligned with a position in
    the prediction and the draft is what comes next there; where the output departs from it, the
    alignment is found again at the first occurrence of the output's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) ahead of where it was lost, else at the last one
    anywhere. Drafts are verified like any other, so the output is what it would be without."""

    __slots__ = ("tokens", "pos", "last", "seen", "ends")

    def __init__(self, tokens: Sequence[int], n_min: int, n_max: int) -> None:
        self.tokens = list(tokens)
        self.pos: int | None = 0   # prediction index aligned with the output's end; None: lost
        self.last = 0              # where the alignment was last known
        self.seen = 0              # output tokens taken into the alignment
        self.ends: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        for n, m in self.ends.items():   # n-gram -> positions right after each of its occurrences
            for e in range(n, len(self.tokens) + 1):
                m.setdefault(tuple(self.tokens[e - n:e]), []).append(e)

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        for t in output[self.seen:]:
            if self.pos is not None and self.pos < len(self.tokens) and self.tokens[self.pos] == t:
                self.pos += 1
                self.last = self.pos
            else:
                self.pos = None
        self.seen = len(output)
        if self.pos is None:
            self.pos = self._resync(output)
        if self.pos is None:
            return []
        return self.tokens[self.pos:self.pos + k]

    def _resync(self, output: Sequence[int]) -> int | None:
        for n in sorted(self.ends, reverse=True):
            if len(output) < n:
                continue
            found = self.ends[n].get(tuple(output[len(output) - n:]))
            if found:
                return next((e for e in found if e >= self.last), found[-1])
        return None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, req, max_k: int) -> list[int]:
        """Drafts for a decoding request (its index lives on the request): from the client's
        predicted output where it has one and the output follows it, else by prompt lookup."""
        k = min(self.config.num_speculative_tokens, max_k)
        if k <= 0:
            return []
        cfg = self.config
        drafts: list[int] = []
        if req.params.prediction:
            if req.prediction is None:
                req.prediction = PredictedOutput(req.params.prediction, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            drafts = req.prediction.propose(req.output_token_ids, k)
        req.drafted_from_prediction = bool(drafts)
        if not drafts:
            index = req.ngram_index
            if index is None:
                index = req.ngram_index = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            drafts = index.propose(req.all_token_ids, k)
        # a thought's forced end drafted (verified at once); structured outputs: what the grammar allows
        return req.shape_drafts(drafts, k)


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified step yields: the accepted drafts, then the first token sampled where a
    draft was rejected (or after the last one). `sampled` has len(drafts) + 1 entries."""
    assert len(sampled) == len(drafts) + 1
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return list(sampled[:a + 1])
