"""A request (one sequence) and the state it owns as it moves through the engine."""
from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch

from sluice.engine.bad_words import BadWords
from sluice.engine.block_pool import Block, BlockHash
from sluice.engine.structured_output import GrammarState, allow_token
from sluice.engine.thinking import ThoughtTracker
from sluice.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_REPETITION = "repetition"   # vLLM's: the output repeated a pattern (repetition_detection)

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING \
            and self is not RequestStatus.PREEMPTED

    @property
    def completed(self) -> bool:
        """Finished by the output itself (end, stop, length, repetition), not aborted or failed:
        the call's KV is worth retaining for its workflow's next call."""
        return self in _COMPLETED


_COMPLETED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_REPETITION})


class Request:
    """One sequence. `num_computed_tokens` chases `num_tokens`; a step that makes them equal samples.

    A request with n > 1 samples is split by the engine into n Requests that share the prompt
    (and its KV blocks, through the prefix cache).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float,
        eos_token_ids: tuple[int, ...] = (),
        workflow_id: Optional[str] = None,
        is_last_step: bool = False,
        generator: Optional[torch.Generator] = None,
        grammar: Optional[GrammarState] = None,
        bad_words: Optional[BadWords] = None,
        thinking: Optional[ThoughtTracker] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.eos_token_ids = eos_token_ids
        self.workflow_id = workflow_id if workflow_id is not None else request_id
        self.has_named_workflow = workflow_id is not None
        self.is_last_step = is_last_step
        self.generator = generator
        self.grammar = grammar                 # structured outputs: advances with every output token it constrains
        self.bad_words = bad_words             # params.bad_words as token sequences (bad_words.py)
        # The thought the reply is in (thinking.py): its budget, and where its grammar starts. None
        # where neither applies (a reply constrained from its first token has no thought).
        self.thinking = thinking
        # Output index of the first token the grammar constrains; None while it waits: for the
        # prompt's open thought to close, or for the first token, which may open a thought
        # (`thought_start`, a one-token start tag: Qwen3's hybrid templates leave it to the model).
        self.grammar_start: Optional[int] = 0
        self.thought_start: Optional[int] = None
        if grammar is not None and thinking is not None and thinking.may_think:
            self.grammar_start, self.thought_start = None, thinking.leading_start

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1            # prefix-cache hit on first admission (-1: not yet)
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.blocks: list[Block] = []
        self.block_hashes: list[tuple[bytes, BlockHash]] = []   # of full blocks of all_token_ids
        self.num_cached_blocks = 0             # leading blocks registered in the prefix cache
        self.state_slot: Optional[int] = None  # hybrid models: recurrent-state slot while running
        self.num_preemptions = 0
        self.protected = False                 # resumed after preemption and made no progress yet
        self.deferred_steps = 0                # consecutive steps it waited for a block while running
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.admit_time: Optional[float] = None
        self.error: Optional[str] = None
        self.ngram_index = None                # speculative decoding's n-gram index (spec_decode.py)
        self.prediction = None                 # params.prediction's drafting state (spec_decode.py)
        self.drafted_from_prediction = False   # the current drafts are params.prediction's
        self.prediction_accepted = 0           # its tokens accepted as drafts
        self.spec_acceptance = 1.0             # moving average of its drafts' acceptance rate
        self.draft_len: Optional[int] = None   # drafts it may take next (adaptive prompt lookup; scheduler.py)
        self.num_new_tokens = 0                # tokens appended by the latest step
        # params.prompt_logprobs: entry i is prompt token i's {token: Logprob}, None for the first
        # token; filled as the prompt's chunks are computed, so its length says how far they
        # reached. Every sample of a group computes them (the engine hands out the first complete
        # list): one sample's output may be streamed before another's prompt has run.
        self.prompt_logprobs: Optional[list] = [None] if params.prompt_logprobs is not None else None
        self.opens_workflow = False            # the first call of its workflow (set by the scheduler)
        # One of the requests the engine makes to run a call (a beam search step's beam): the call,
        # not this request, counts for its workflow (calls, retention, call sizes; llm_engine.py).
        self.part_of_call = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt positions are still to be computed for their logprobs: prefix-cache hits must
        stop where the logprobs reached (`max_prompt_hit`)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def max_prompt_hit(self) -> int:
        """While `needs_prompt_logprobs`: the most leading tokens a prefix-cache hit may skip. The
        logits of positions 0..k-1 gave the logprobs of tokens 1..k, so with L entries known, L - 1
        positions need no recompute."""
        return len(self.prompt_logprobs) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_tokens_to_compute == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    @property
    def constrained(self) -> bool:
        """The grammar constrains the next token (structured outputs, past any opening thought)."""
        return self.grammar is not None and self.grammar_start is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is None:
            return
        if self.grammar_start is None:
            if self.num_output_tokens == 1 and self.thought_start is not None and token_id != self.thought_start:
                self.grammar_start = 0          # the reply opened no thought: its first token is the answer's
            elif not self.thinking.is_open(self.all_token_ids):   # the thought closed: the answer starts
                self.grammar_start = len(self.output_token_ids)
                return
            else:
                return
        if not self.grammar.consume(token_id):
            self.error = f"structured outputs: the grammar rejected token {token_id}: {self.grammar.error}"

    def drop_output_tail(self, k: int) -> None:
        """Forget the last k output tokens (speculated past a stop string: never produced)."""
        if k > 0:
            kept = self.num_output_tokens - k
            if self.grammar_start is not None and self.grammar is not None and self.error is None:
                self.grammar.rollback(self.num_output_tokens - max(kept, self.grammar_start))
            if self.grammar_start is not None and (kept < self.grammar_start
                                                   or kept == 0 and self.thought_start is not None):
                self.grammar_start = None       # the thought's end (or the first token) went with the tail
            del self.output_token_ids[-k:]
            del self.all_token_ids[-k:]
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def check_stop(self, max_model_len: int) -> Optional[RequestStatus]:
        """Token-level stop conditions after a token was appended (stop strings are checked later)."""
        tok = self.output_token_ids[-1]
        n = self.num_output_tokens
        if self.constrained:
            if self.error is not None:
                return RequestStatus.FINISHED_ERROR
            if self.grammar.is_stopped:      # the output is complete (its end token, if any, taken)
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if n >= self.params.min_tokens:
            if not self.params.ignore_eos and tok in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if tok in self.params.stop_token_ids:
                self.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if n >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        rep = self.params.repetition_detection
        if rep is not None and rep.enabled and n >= self.params.min_tokens and rep.repeats(self.output_token_ids):
            self.stop_reason = "repetition_detected"
            return RequestStatus.FINISHED_REPETITION
        return None

    def suppressed_token_ids(self, ahead: int = 0) -> tuple[int, ...]:
        """Ids the sampler must not pick now (end tokens before min_tokens is reached); `ahead`:
        for the token after that many more (speculated) output tokens."""
        if self.num_output_tokens + ahead >= self.params.min_tokens:
            return ()
        ids = tuple(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids += self.eos_token_ids
        return ids

    def banned_token_ids(self, drafts: Sequence[int] = ()) -> tuple[int, ...]:
        """Ids `bad_words` forbids next (after the output and then `drafts`, speculated tokens)."""
        return self.bad_words.banned(self.output_token_ids, drafts) if self.bad_words is not None else ()

    def forced_token_ids(self, drafts: Sequence[int] = ()) -> Optional[list[Optional[int]]]:
        """The token each position sampled after the output and drafts[:j] must be (j in
        0..len(drafts); None where it is free): a thought's forced end; None when none is forced
        (also once a grammar constrains the answer: the thought is over)."""
        if self.thinking is None or self.constrained:
            return None
        return self.thinking.forced(self.all_token_ids, drafts)

    def grammar_masks(self, drafts: Sequence[int] = ()) -> Optional[list[Optional[torch.Tensor]]]:
        """Structured outputs' token mask of each position sampled after the output and drafts[:j]
        (None where the thought is still open), or None when no position is constrained."""
        if self.grammar is None:
            return None
        if self.grammar_start is not None:
            return list(self.grammar.masks(drafts))
        c = self._answer_start(drafts)
        rows = [None] * (len(drafts) + 1) if c is None else [None] * c + list(self.grammar.masks(drafts[c:]))
        if self.thought_start is not None and self.num_output_tokens == 0:   # the answer, or a thought
            rows[0] = allow_token(rows[0] if rows[0] is not None else self.grammar.masks()[0], self.thought_start)
        return rows if any(m is not None for m in rows) else None

    def _answer_start(self, drafts: Sequence[int]) -> Optional[int]:
        """While the grammar waits: the position among `drafts` where the answer starts (after the
        thought; at once where the first token opens none), None when not within them."""
        if self.thought_start is not None and self.num_output_tokens == 0:
            if not drafts or drafts[0] != self.thought_start:
                return 0
            return self.thinking.closes(self.all_token_ids, drafts, first=1)
        return self.thinking.closes(self.all_token_ids, drafts)

    def shape_drafts(self, drafts: list[int], k: int) -> list[int]:
        """Prompt-lookup drafts (at most k) as this request can take them: a thought's forced end
        written in, and no further than its grammar allows."""
        if self.thinking is not None and not self.constrained:
            drafts = self.thinking.overlay(self.all_token_ids, drafts, k)
        if drafts and self.grammar is not None:
            if self.grammar_start is not None:
                return drafts[:self.grammar.valid_prefix(drafts)]
            c = self._answer_start(drafts)
            if c is not None:
                return drafts[:c + self.grammar.valid_prefix(drafts[c:])]
        return drafts

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={len(self.blocks)})")
