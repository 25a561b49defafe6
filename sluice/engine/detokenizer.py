"""Incremental detokenization with stop strings, for streaming one sequence's output.

The decoding follows vLLM's `detokenize_incrementally`: each step decodes a short window of
tokens twice, once up to the last token already turned into text (`_read_offset`) and once up
to the newest token, and emits the difference. A window whose text ends in U+FFFD is a UTF-8
character still split across tokens (an emoji's first bytes, say), so its tokens are held
back until a later token completes the character. Decoding a window rather than one token at
a time keeps the tokenizer's context-dependent rules right (SentencePiece's leading space,
WordPiece's `##`), and the first window reaches a few tokens into the prompt for that reason.

`tokenizers.decoders.DecodeStream` implements the same algorithm in Rust, but it offers no way
to release held bytes that never complete (a model can stop in the middle of a character, and
the final text must then match `decode()`, U+FFFD included), and it needs the raw
`tokenizers.Tokenizer` that `sluice.tokenizer.Tokenizer` keeps private; at two decodes of a
few tokens per step the Python version costs microseconds, so it is used instead.
"""
from __future__ import annotations

from typing import Optional, Sequence

from sluice.tokenizer import Tokenizer

# How many prompt tokens the first decode window reaches back, as in vLLM.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text deltas and watches for stop strings.

    Contract:
    - `add_tokens(ids)` returns `(delta, stop)`. Concatenating every delta, plus `flush()` at
      the end, gives the output text: `decode(output_ids)` in the prompt's context (identical
      to `tokenizer.decode(output_ids)` for byte-level BPE tokenizers such as SmolLM2's),
      truncated at the first stop string.
    - No delta ends with a partial UTF-8 character; those tokens wait for the rest of it.
    - Unless `include_stop_str_in_output`, the last `max(len(s) for s in stop) - 1` characters
      are held back, so a stop string split over several tokens never reaches the client in
      part. With it, nothing is held back, since any prefix of a match stays in the output.
    - When a stop string appears, the text is cut at its start (or after its end when
      `include_stop_str_in_output`), the delta up to that point is returned with the matched
      string, and the detokenizer is finished: later `add_tokens` calls return `("", None)`.
      Among matches completed by the same call, the one that starts earliest wins (ties go to
      the one listed first in `stop`).
    - `flush()` is called once the sequence finishes for any other reason (EOS, stop token,
      length): it releases the held-back characters and any bytes of a character that never
      completed, which then decode to U+FFFD as `decode()` would. A stop string completed only
      by those released characters is still honoured (see `stop_reason`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Optional[list[str]] = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._hold_chars = 0 if include_stop_str_in_output else max(
            (len(s) for s in self._stop), default=1
        ) - 1
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context          # decode window source: prompt tail + output
        self._prefix_offset = 0                  # window start in self._ids
        self._read_offset = len(context)         # ids before this are already in self._decoded
        self._decoded = ""                       # text of the output, complete characters only
        self._emitted = 0                        # characters of self._decoded sent as deltas
        self._stop_reason: Optional[str] = None
        self._finished = False

    @property
    def text(self) -> str:
        """The text sent so far: the concatenation of every delta returned (and the flush)."""
        return self._decoded[: self._emitted]

    @property
    def stop_reason(self) -> Optional[str]:
        """The stop string that ended the text, or None."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `flush()` ran."""
        return self._finished

    def add_tokens(self, new_ids: Sequence[int]) -> tuple[str, Optional[str]]:
        """Append sampled token ids; return (text delta, matched stop string or None)."""
        if self._finished or not new_ids:
            return "", None
        self._ids.extend(new_ids)
        self._append_text(self._decode_pending(final=False))
        return self._release(final=False)

    def flush(self) -> str:
        """Release all remaining text at the end of the sequence; returns the last delta."""
        if self._finished:
            return ""
        self._append_text(self._decode_pending(final=True))
        delta, _ = self._release(final=True)
        self._finished = True
        return delta

    def _decode_pending(self, final: bool) -> str:
        """The text of the tokens after `_read_offset`, or "" while it ends mid-character."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) and not final:
            return ""  # e.g. a skipped special token: nothing visible yet
        if full.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _append_text(self, new_text: str) -> None:
        """Add decoded text and cut it at the first stop string it completes, if any."""
        if not new_text:
            return
        old_len = len(self._decoded)
        self._decoded += new_text
        if not self._stop:
            return
        best: Optional[tuple[int, str]] = None
        for s in self._stop:
            # A new match must end inside the new text, so it starts at most len(s)-1 before.
            pos = self._decoded.find(s, max(0, old_len - len(s) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            pos, s = best
            self._decoded = self._decoded[: pos + len(s) if self._include_stop else pos]
            self._stop_reason = s

    def _release(self, final: bool) -> tuple[str, Optional[str]]:
        """Emit the decoded text not sent yet, keeping the stop-string hold-back unless final."""
        if self._stop_reason is not None:
            self._finished = True
            end = len(self._decoded)
        elif final:
            end = len(self._decoded)
        else:
            end = max(self._emitted, len(self._decoded) - self._hold_chars)
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return delta, self._stop_reason

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
