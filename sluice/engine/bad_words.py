"""`bad_words` (vLLM's sampling parameter): words the output must not contain, as token sequences.

A word is banned in the token sequences it tokenizes to on its own and, where that gives a
different first token of the same length, with a space in front (the form it takes inside a
sentence): vLLM's rule, so a request means the same on both engines. A sequence's last token is
forbidden whenever the output ends with the rest of it (a one-token word is forbidden always).
Only output tokens count: a sequence whose first tokens end the prompt does not ban its last one.
"""
from __future__ import annotations

from typing import Sequence

from sluice.tokenizer import Tokenizer

MAX_BAD_WORD_SEQUENCES = 128   # vLLM's default VLLM_MAX_NUM_BAD_WORDS


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """The token sequences `words` ban; ValueError for a word that tokenizes to nothing or for
    more than MAX_BAD_WORD_SEQUENCES sequences."""
    seqs: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad_words entries must tokenize to at least one token, got {word!r}")
        seqs.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
        if len(seqs) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(f"bad_words may ban at most {MAX_BAD_WORD_SEQUENCES} token sequences "
                             "(each word counts once or twice: alone and after a space)")
    return seqs


class BadWords:
    """A request's banned sequences, asked per position for the tokens to forbid next."""

    __slots__ = ("seqs", "longest_prefix")

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs = [tuple(s) for s in seqs]
        self.longest_prefix = max(len(s) for s in self.seqs) - 1

    def banned(self, output: Sequence[int], drafts: Sequence[int] = ()) -> tuple[int, ...]:
        """Ids not to sample after `output` followed by `drafts` (speculated tokens)."""
        n = self.longest_prefix
        tail = list(output[-n:]) + list(drafts) if n else []
        tail = tail[len(tail) - n:] if len(tail) > n else tail
        out = []
        for seq in self.seqs:
            p = len(seq) - 1
            if p == 0 or (p <= len(tail) and tuple(tail[len(tail) - p:]) == seq[:p]):
                out.append(seq[p])
        return tuple(out)
