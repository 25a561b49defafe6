"""A sequence's thought, tracked in tokens: where it closes (structured outputs start there) and
where `thinking_token_budget` (vLLM's sampling parameter) cuts it.

The engine knows a thinking model's tags as token sequences (`ThinkingTags`, from the
`ReasoningConfig` a reasoning parser or `--reasoning-config` gives). A sequence's thought is open
from the token after its latest start tag until its end tag. Once an open thought holds `budget`
tokens (those the prompt already holds after its last start tag count: a generation prompt that
opens the thought, a prefill inside one), the next tokens are forced, one position at a time, to
the forced end (the end tag, or a transition phrase ending with it), whatever the model would
sample; after it the thought is closed and the output is free, and a later thought gets a budget
of its own. vLLM's rule (its v1/sample/thinking_budget_state.py).

A reply whose prompt leaves a thought open (GLM-5.x's generation prompt, DeepSeek-R1's and the
Qwen3 thinking templates) is constrained by its structured outputs from the token after the thought
closes (`closes`): the thought is free text, the answer obeys the grammar, as in vLLM. A reply
that does not start inside a thought is constrained from its first token.

Forcing works per sampled position, so it composes with speculative decoding: a verified position
that must be forced takes its forced token (`forced`), and the prompt-lookup drafts are overwritten
with the forced tokens (`overlay`) so a whole forced end is accepted in one step. Tags are matched
as token sequences, as vLLM does: a model that spells a tag in other tokens is not seen to use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from sluice.config import ReasoningConfig
from sluice.tokenizer import Tokenizer


@dataclass(frozen=True)
class ThinkingTags:
    start: tuple[int, ...]
    end: tuple[int, ...]        # the end a model writes itself
    forced: tuple[int, ...]     # what is forced at the budget

    @classmethod
    def from_config(cls, config: ReasoningConfig, tokenizer: Tokenizer) -> "ThinkingTags":
        """The config's strings as token sequences; ValueError for one that tokenizes to nothing."""
        seqs = []
        for name, text in (("start", config.start), ("end", config.end), ("forced end", config.forced)):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not ids:
                raise ValueError(f"the reasoning {name} string {text!r} tokenizes to nothing")
            seqs.append(ids)
        return cls(*seqs)


def _ends_with(seq: Sequence[int], i: int, tag: tuple[int, ...]) -> bool:
    """Whether seq[:i + 1] ends with `tag`."""
    j = i + 1 - len(tag)
    return j >= 0 and seq[i] == tag[-1] and tuple(seq[j:i + 1]) == tag


class ThoughtTracker:
    """One sequence's thought state as its tokens grow. The state after a token list is (open_at,
    force_at): where the open thought's tokens begin (None: no open thought) and where the forced
    end began (None: not forcing). Positions are indices into prompt + output. `budget` None
    forces nothing (the tracker only says where the thought closes)."""

    __slots__ = ("tags", "budget", "_prompt_state", "_prompt_len", "_len", "_state", "_window")

    def __init__(self, tags: ThinkingTags, budget: Optional[int], prompt: Sequence[int]) -> None:
        self.tags, self.budget = tags, budget
        self._window = max(len(tags.start), len(tags.end)) - 1   # tokens before a position a tag may span
        n = len(prompt)
        open_at = None
        for i in range(n - 1, -1, -1):   # the prompt's last tag decides (an end tag first: it may hold a start)
            if _ends_with(prompt, i, tags.end):
                break
            if _ends_with(prompt, i, tags.start):
                open_at = i + 1
                break
        over = open_at is not None and budget is not None and n - open_at >= budget
        self._prompt_state = (open_at, n if over else None)
        self._prompt_len = n
        self._len, self._state = n, self._prompt_state

    @property
    def opens_in_prompt(self) -> bool:
        """The prompt leaves a thought open: the reply starts inside it."""
        return self._prompt_state[0] is not None

    @property
    def leading_start(self) -> Optional[int]:
        """Where the prompt opens no thought: the token that opens one as the reply's first, when
        the start tag is one token (Qwen3's and GLM's are; Qwen3's hybrid templates leave the tag to
        the model); else None."""
        return self.tags.start[0] if not self.opens_in_prompt and len(self.tags.start) == 1 else None

    @property
    def may_think(self) -> bool:
        """A constrained reply may think before its answer (its grammar starts after the thought):
        the prompt opens the thought, or the reply's first token may."""
        return self.opens_in_prompt or self.leading_start is not None

    def _after(self, seq: Sequence[int], i: int, base: int, state: tuple) -> tuple:
        """The state after seq[i] (absolute position base + i), from the state before it."""
        open_at, force_at = state
        pos = base + i
        if force_at is not None:
            return (None, None) if pos + 1 - force_at >= len(self.tags.forced) else state
        if _ends_with(seq, i, self.tags.end):
            open_at = None
        elif _ends_with(seq, i, self.tags.start):
            open_at = pos + 1
        if open_at is not None and self.budget is not None and pos + 1 - open_at >= self.budget:
            force_at = pos + 1
        return open_at, force_at

    def _sync(self, tokens: Sequence[int]) -> tuple:
        """The state after `tokens` (prompt + output), advanced from the last call's."""
        if len(tokens) < self._len:   # the output lost its tail: from the prompt again
            self._len, self._state = self._prompt_len, self._prompt_state
        state = self._state
        for i in range(self._len, len(tokens)):
            state = self._after(tokens, i, 0, state)
        self._len, self._state = len(tokens), state
        return state

    def _tail(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        """The last tokens a tag ending in a draft may span, and the position of the first."""
        base = max(0, len(tokens) - self._window)
        return list(tokens[base:]), base

    def _walk(self, tokens: Sequence[int], drafts: Sequence[int]):
        """The state before each position sampled after `tokens` then drafts[:j], j = 0..len(drafts)."""
        state = self._sync(tokens)
        seq, base = self._tail(tokens)
        for j in range(len(drafts) + 1):
            yield state
            if j < len(drafts):
                seq.append(drafts[j])
                state = self._after(seq, len(seq) - 1, base, state)

    def is_open(self, tokens: Sequence[int]) -> bool:
        """Whether a thought is open (or its forced end is being written) after `tokens`."""
        return self._sync(tokens) != (None, None)

    def closes(self, tokens: Sequence[int], drafts: Sequence[int] = (), first: int = 0) -> Optional[int]:
        """The least j in first..len(drafts) with no thought open after `tokens` then drafts[:j];
        None when it stays open through the drafts."""
        return next((j for j, state in enumerate(self._walk(tokens, drafts))
                     if j >= first and state == (None, None)), None)

    def forced(self, tokens: Sequence[int], drafts: Sequence[int] = ()) -> Optional[list[Optional[int]]]:
        """The forced token of each position sampled after `tokens` then drafts[:j], for j in
        0..len(drafts) (None where the position is free); None when none is forced."""
        if self.budget is None:
            return None
        forced = self.tags.forced
        out = [forced[len(tokens) + j - f] if (f := state[1]) is not None else None
               for j, state in enumerate(self._walk(tokens, drafts))]
        return out if any(t is not None for t in out) else None

    def overlay(self, tokens: Sequence[int], drafts: Sequence[int], k: int) -> list[int]:
        """Drafts (at most k) with every forced position holding its forced token, so the forced
        end is verified at once. A forced run that changed the drafts ends them (what was copied
        after it followed other tokens)."""
        if self.budget is None:
            return list(drafts[:k])
        state = self._sync(tokens)
        seq, base = self._tail(tokens)
        out: list[int] = []
        changed = False
        for j in range(k):
            force_at = state[1]
            if force_at is not None:
                tok = self.tags.forced[len(tokens) + j - force_at]
                changed = changed or j >= len(drafts) or drafts[j] != tok
            elif changed or j >= len(drafts):
                break
            else:
                tok = drafts[j]
            out.append(tok)
            seq.append(tok)
            state = self._after(seq, len(seq) - 1, base, state)
        return out
