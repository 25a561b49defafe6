"""Beam search (vLLM's `use_beam_search`), as vLLM runs it: every step extends each live beam by
its 2w most likely next tokens (w the beam width, the request's `n`), and the w best of those
candidates by cumulative logprob become the next step's beams. A candidate that ends the
sequence (an end-of-sequence token, unless `ignore_eos`, or one of `stop_token_ids`) is set aside
as a finished beam instead. After `max_tokens` steps (or when no beam is left) the finished and
the live beams are ranked by cumulative logprob / length ** length_penalty, where the length
counts the prompt and the output without its end token (vLLM's rule), and the w best are the
output.

This module is the search alone, on hand-made logprobs; the engine (llm_engine.py) runs each
step's beams as one-token requests of its own that share the prompt and the beams' common
prefixes through the prefix cache, so a step computes only the tokens past each beam's last
full block. Unlike vLLM's, the search is deterministic: the candidates are the model's most
likely tokens alone (vLLM also adds each beam's sampled token, at the request's temperature),
and ties go to the earlier beam, then to the likelier token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from sluice.outputs import Logprob
from sluice.sampling_params import SamplingParams


@dataclass
class Beam:
    token_ids: list[int]                      # output tokens (a finished beam's end token only if kept)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)   # per output position
    finish_reason: Optional[str] = None       # "stop" for a beam that chose an end token
    stop_reason: Optional[int] = None         # that token, if one of stop_token_ids (EOS: None, as in sampling)
    ended_by_token: bool = False              # token_ids ends with the end token it chose


class BeamSearch:
    def __init__(self, prompt_len: int, params: SamplingParams, max_tokens: int, eos_token_ids: Sequence[int]) -> None:
        """`params`: the request's (`n` the width; `min_tokens`, `ignore_eos`, `stop_token_ids`,
        `length_penalty`, `include_stop_str_in_output`); `max_tokens` resolved against the context."""
        self.prompt_len = prompt_len
        self.width = params.n
        self.max_tokens = max_tokens
        # An end token finishes a beam, the tokens that stop sampling (Request.check_stop):
        # `stop_token_ids` always, EOS unless ignore_eos (then it is an ordinary candidate).
        self.eos_ends = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.end_token_ids = frozenset(params.stop_token_ids) | self.eos_ends
        self.min_tokens = params.min_tokens
        self.length_penalty = params.length_penalty
        self.keep_end_token = params.include_stop_str_in_output
        self.beams: list[Beam] = [Beam([])]
        self.finished: list[Beam] = []
        self.steps = 0

    @property
    def num_candidates(self) -> int:
        """How many of a beam's most likely next tokens a step considers."""
        return 2 * self.width

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.max_tokens

    def advance(self, entries: list[dict[int, Logprob]]) -> None:
        """One step: `entries[i]` holds live beam i's most likely next tokens (at least
        `num_candidates` of them, or the whole vocabulary) with their logprobs."""
        assert len(entries) == len(self.beams) and not self.done
        candidates: list[tuple[float, int, int, int]] = []   # (cumulative logprob, beam, rank, token)
        for b, (beam, entry) in enumerate(zip(self.beams, entries)):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:self.num_candidates]
            may_end = len(beam.token_ids) >= self.min_tokens
            for rank, (token, lp) in enumerate(top):
                score = beam.cumulative_logprob + lp.logprob
                if token in self.end_token_ids:
                    if may_end:
                        kept = beam.token_ids + [token] if self.keep_end_token else list(beam.token_ids)
                        self.finished.append(Beam(kept, score, beam.logprobs + [entry], "stop",
                                                  None if token in self.eos_ends else token,
                                                  ended_by_token=self.keep_end_token))
                    continue
                candidates.append((score, b, rank, token))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        self.beams = [Beam(self.beams[b].token_ids + [token], score, self.beams[b].logprobs + [entries[b]])
                      for score, b, _, token in candidates[:self.width]]
        self.steps += 1

    def score(self, beam: Beam) -> float:
        length = self.prompt_len + len(beam.token_ids) - (1 if beam.ended_by_token else 0)
        return beam.cumulative_logprob / (max(length, 1) ** self.length_penalty)

    def best(self, finish_reason: str = "length") -> list[Beam]:
        """The output: the `width` best of the finished and the live beams (the live ones end
        with `finish_reason`), best first; ties keep the order they were found in."""
        live = [Beam(b.token_ids, b.cumulative_logprob, b.logprobs, finish_reason) for b in self.beams]
        ranked = sorted(self.finished + live, key=self.score, reverse=True)
        return ranked[:self.width]
