"""Reasoning in a reply (`--reasoning-parser`, vLLM's flag): the text a thinking model writes
between `<think>` and `</think>` is the reply's reasoning, the rest its content.

One format covers the parsers sluice accepts (vLLM's names `deepseek_r1`, `qwen3`, `glm45`,
`glm47`): their models think between those two tags. Where the reply starts is read from the
prompt: a prompt whose last `<think>` is open (a generation prompt that opens it: GLM-5.x always,
DeepSeek-R1 and Qwen3's thinking templates; or a response prefill inside a thought) starts the
reply inside its reasoning, which runs to `</think>` (or to
the end of a reply cut short); otherwise the reply is content until a `<think>` opens reasoning
(GLM-4.5 and Qwen3 write the tag themselves; a template that turned thinking off wrote
`<think></think>` and the reply is content). A stray `</think>` in content is dropped. With a
tool-call parser, a `<tool_call>` inside reasoning also ends it (GLM may call a tool without
closing its thought); calls are parsed in content only.

Events: reasoning comes out as `ReasoningDelta`s, content goes through the tool-call parser when
there is one (its events: strings and calls), else as strings. Text is held back only while it
could be the start of a tag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

THINK_START = "<think>"
THINK_END = "</think>"
_TOOL_CALL_START = "<tool_call>"


@dataclass
class ReasoningDelta:
    text: str


def starts_in_reasoning(prompt_tail: str) -> bool:
    """Whether a reply to a prompt ending with `prompt_tail` starts inside its reasoning: the
    tail's last `<think>` is not closed (a generation prompt that opens the thought, or a response
    prefill that is inside one)."""
    start = prompt_tail.rfind(THINK_START)
    return start >= 0 and prompt_tail.find(THINK_END, start) < 0


def split_held(text: str, tags: tuple[str, ...]) -> tuple[str, str]:
    """`text` as (what is certain, what is held): the held part is its longest end that is a
    proper prefix of one of `tags` (the start of a tag the next delta may complete)."""
    held = 0
    for tag in tags:
        for k in range(min(len(text), len(tag) - 1), held, -1):
            if tag.startswith(text[-k:]):
                held = k
                break
    return text[:len(text) - held], text[len(text) - held:]


def first_tag(text: str, tags: tuple[str, ...]) -> Optional[tuple[int, str]]:
    """The position and tag of the earliest of `tags` in `text`, None when none is in it."""
    found = [(i, tag) for tag in tags if (i := text.find(tag)) >= 0]
    return min(found) if found else None


class ReasoningStream:
    """Splits a reply into reasoning and content as its text arrives: `feed(delta)` and at the end
    `finish()` return the events that are certain so far, in order. `content` makes the parser
    content goes through (a tool-call parser), or None for plain text; with `keep` false the
    reasoning is dropped (vLLM's `include_reasoning: false`); `leading` for a constrained reply
    (one thought at most, at its start)."""

    def __init__(self, in_reasoning: bool, content: Optional[Callable[[], Any]] = None, keep: bool = True,
                 leading: bool = False) -> None:
        self._in_reasoning = in_reasoning
        self._keep = keep
        self._content = content() if content is not None else None
        # what ends a thought: its closing tag, and a call's opening tag when calls are parsed
        self._ends = (THINK_END, _TOOL_CALL_START) if self._content is not None else (THINK_END,)
        self._pending = ""
        # `leading`: a constrained reply, whose only thought is one it starts in or opens with its
        # first text; after it (or from the first text that opens none) every character is
        # content, tags included (a JSON string may hold one).
        self._leading = leading
        self._verbatim = False

    def feed(self, delta: str) -> list[Any]:
        self._pending += delta
        events: list[Any] = []
        while True:
            if self._in_reasoning:
                found = first_tag(self._pending, self._ends)
                if found is None:
                    certain, self._pending = split_held(self._pending, self._ends)
                    return events + self._thought(certain)
                i, tag = found
                events += self._thought(self._pending[:i])
                # a closing tag is consumed; a call's opening tag starts the content
                self._pending = self._pending[i + len(THINK_END):] if tag == THINK_END else self._pending[i:]
                self._in_reasoning = False
                self._verbatim = self._leading
                continue
            if self._verbatim:
                text, self._pending = self._pending, ""
                return events + self._to_content(text)
            if self._leading:   # the reply's first text: a thought opens here or nowhere
                if THINK_START.startswith(self._pending):
                    return events          # (all of it could still be the tag)
                if self._pending.startswith(THINK_START):
                    self._pending = self._pending[len(THINK_START):]
                    self._in_reasoning = True
                else:
                    self._verbatim = True
                continue
            found = first_tag(self._pending, (THINK_START, THINK_END))
            if found is None:
                certain, self._pending = split_held(self._pending, (THINK_START, THINK_END))
                return events + self._to_content(certain)
            i, tag = found
            events += self._to_content(self._pending[:i])
            self._pending = self._pending[i + len(tag):]
            self._in_reasoning = tag == THINK_START

    def finish(self) -> list[Any]:
        pending, self._pending = self._pending, ""
        if self._in_reasoning:
            return self._thought(pending)
        events = self._to_content(pending)
        if self._content is not None:
            events += self._content.finish()
        return events

    def _thought(self, text: str) -> list[Any]:
        return [ReasoningDelta(text)] if text and self._keep else []

    def _to_content(self, text: str) -> list[Any]:
        if not text:
            return []
        return self._content.feed(text) if self._content is not None else [text]


def reasoning_text(events: list[Any]) -> Optional[str]:
    """A whole reply's reasoning, None when it has none."""
    parts = [e.text for e in events if isinstance(e, ReasoningDelta)]
    return "".join(parts) if parts else None
