"""Continuous batching on a per-step token budget.

There are no prefill and decode phases: every request has `num_computed_tokens` chasing
`num_tokens`, and each step hands out at most `max_num_batched_tokens` tokens: one to each
running decode first (so a long prefill never stalls them), then chunks of pending prefills,
then newly admitted requests in policy order (their prefix-cache hits count as computed).
While prompt tokens wait, the decodes sit out up to `decode_yield_steps` consecutive steps
(default 1: every other step at most), which the prompts then have alone: a decode's share of
a mixed step is mostly reading its sequence's K/V (~80-100 ms for 30 sequences of 2k tokens
here), and a call's first token comes that much sooner per step its prompt takes. A stalled
decode loses one step; over the call it is a small part of its generation time, while the
time to first token of agent calls (a ~270-token tool result each) fell by ~12% at the median
and ~14% at p90 on sustained traffic, throughput unchanged (docs/benchmarks.md, session 15).
A step whose prompt work cannot run after all (no blocks, no sequence slot) carries the
decodes as usual.
Once a step holds `close_step_tokens` tokens (default 128), the first prompt it completes closes
it to further prompt chunks: the call's first token comes at the step's end, and a chunk added
after it would only hold it back (every token of a step finishes together) while starting work
that the next step does as well. What it costs is a step's fixed cost now and then. On the
replay (virtual clock, 3 seeds), with the workflow policy's shortest-remaining-prompt tie-break,
it cut TTFT p50 by 14% (the agent's own replies in the history) and 19% (drawn replies),
throughput unchanged; 256 did better on drawn replies (-23%) but only -3% on its own replies,
whose calls have fewer new tokens (docs/benchmarks.md, session 38).
When blocks run out, retained workflow KV is released first; then a prefill chunk shrinks to
the slots that remain, and a request that still cannot grow waits (up to `MAX_DEFER_STEPS`
steps) while another running request can progress in the blocks it has, since calls finishing
meanwhile free memory (no block is free then, so nothing new is admitted). Only when nothing
can progress, or the wait is over, is the lowest-priority running request preempted (its blocks
freed; it recomputes later, from the prefix cache as far as its blocks survive): the one asking
may yield itself, and one already scheduled this step is withdrawn from the batch. (Under KV pressure,
preempting at the first block shortage threw away ~16k computed tokens per 96-workflow replay.)

Hybrid models (linear-attention layers with a recurrent state) also get a state slot per running
request from a `StatePool` (see state_pool.py): taken at admission, given back on finish, abort
and preemption. Their prefix-cache hits are cut back to the deepest block with a state snapshot,
and each step plans a snapshot at the last block boundary a request's chunk crosses (when the
pool has snapshot slots: with none, such a model gets no prefix-cache hits).

Speculative decoding (prompt lookup, see spec_decode.py): a decode may carry drafts, so it
computes 1 + k tokens. Drafts only use what is spare: they are added last, from the token budget
that decodes and prefill chunks left, and take a new block only while blocks are plentiful;
they never cause a preemption, a retention release or a delay to anything else. After the step
only the accepted tokens count as computed; the KV of rejected drafts sits past
`num_computed_tokens` (blocks past the request's tokens are given back) and is overwritten.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from sluice.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from sluice.engine.admission import WorkflowLimit
from sluice.engine.block_pool import BlockPool
from sluice.engine.errors import RequestRejected
from sluice.engine.kv_cache_manager import KVCacheManager
from sluice.engine.policies import create_policy
from sluice.engine.request import Request, RequestStatus
from sluice.engine.spec_decode import NgramProposer
from sluice.engine.state_pool import StateLayout, StatePool
from sluice.engine.stats import EngineStats
from sluice.engine.workflow import WorkflowTracker


@dataclass
class SchedulerOutput:
    # (request, tokens to compute this step): decodes first, then prefill chunks.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # per scheduled entry: whether this step completes the request's tokens (so it samples)
    samples: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Hybrid models only. Slots to set up before the step: (state slot, snapshot slot to copy
    # from, or None for zeros).
    state_inits: list[tuple[int, Optional[int]]] = field(default_factory=list)
    # request id -> (tokens of its chunk before a block boundary, snapshot slot to save into).
    state_saves: dict[str, tuple[int, int]] = field(default_factory=dict)
    # request id -> draft tokens it verifies this step (its entry computes 1 + len(drafts) tokens).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.scheduled


# Below this acceptance (a moving average per request), a request drafts one token at a time: a
# draft costs about a third of what an accepted one saves in a batch-32 decode step here.
LOW_ACCEPTANCE = 0.3

# Adaptive draft length (SpeculativeConfig.adaptive): a request drafts up to its own `draft_len`,
# which starts at START_DRAFTS, grows by 2 after a verification that accepted every draft it was
# given and shrinks by 1 after one that rejected any, within 1 .. num_speculative_tokens. Prompt
# lookup on agent traffic drafts long runs where a call copies its context (a tool result, JSON
# it was shown) and little elsewhere, so the drafts go where they are accepted; at equilibrium a
# request's last draft is accepted about a third of the time (grown with probability p, shrunk
# with 1 - p: p = 1/3), the break-even LOW_ACCEPTANCE states. In a step that carries prompt
# tokens a request drafts at most START_DRAFTS: that step's length is a waiting call's time to
# first token. Session 46 (AMX host, bound 16, docs/measured/s46/adapt-k.txt): against a fixed 6,
# +7% throughput and +22% generation speed for +3% TTFT p50 (fixed 16: +4%, TTFT p50 +14%).
START_DRAFTS = 6


class Scheduler:
    # Steps a running request short of a block may wait while others progress, before a
    # preemption makes room for it (a decode crosses a block boundary every block_size tokens).
    MAX_DEFER_STEPS = 8
    # Whether a running prefill short of blocks computes the part that fits before anything else.
    SHRINK_CHUNKS = True

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 clock: Callable[[], float] = time.monotonic, state: Optional[StateLayout] = None,
                 speculative: Optional[SpeculativeConfig] = None) -> None:
        self.config = config
        self.block_size = cache.block_size
        self.clock = clock
        self.pool = BlockPool(num_blocks, cache.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, cache.block_size)
        self.states = StatePool(state) if state is not None else None
        self.workflows = WorkflowTracker(self.pool, config.retention_ttl_s)
        self.policy = create_policy(config, self.workflows)
        m = config.max_active_workflows
        self.workflow_limit = (WorkflowLimit(auto=True, maximum=config.max_num_seqs, band=config.auto_overhead_band,
                                             step_ratio=config.auto_step_ratio)
                               if m == "auto" else WorkflowLimit(fixed=m))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Blocks of a finished call (prompt + output), a moving average: the size of a call of a
        # workflow admitted now, for `accepting`. Starts at 1k tokens or an eighth of the cache.
        self.typical_call_blocks = min(self.kv.blocks_for(1024), max(1, num_blocks // 8))
        # Blocks a finished call added beyond the prefix it found cached (its new prompt tokens
        # and its output), a moving average: what a retained workflow's next call will need.
        self.typical_growth_blocks = max(1, self.typical_call_blocks // 2)
        self.typical_final_blocks = self.typical_call_blocks   # a workflow's last call
        # Uncached prompt tokens of a workflow's first call (moving average; before any: one
        # token budget): what each new workflow `/load` welcomes adds to the prefill backlog.
        self.typical_first_prompt_tokens = float(config.max_num_batched_tokens)
        self._first_prompts_seen = 0
        self.num_preemptions = 0
        self._held_workflows: set[str] = set()   # workflows whose num_blocks_held is set
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Speculative decoding; not for hybrid models (a recurrent state cannot roll back).
        self.proposer = NgramProposer(speculative) if speculative is not None and state is None else None
        self.spec_config = speculative
        self.spec_drafts_total = 0             # verification entries with at least one draft
        self.spec_draft_tokens_total = 0
        self.spec_accepted_tokens_total = 0
        self._prompts_closed = False   # this step takes no more prompt chunks (close_step_tokens)
        self._decode_yields = 0   # consecutive steps the running decodes sat out (decode_yield_steps)
        self.decode_yield_steps_total = 0

    # --- admission ----------------------------------------------------------------------
    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.num_tokens_to_compute for r in self.waiting)

    def check_admission(self, num_requests: int, num_tokens: int) -> None:
        """Raise 429 if accepting these calls would exceed the waiting-queue bounds."""
        c = self.config
        if c.max_waiting_requests is not None and len(self.waiting) + num_requests > c.max_waiting_requests:
            raise RequestRejected(
                f"server is at capacity: {len(self.waiting)} requests waiting (limit {c.max_waiting_requests})",
                status_code=429, code="rate_limit_exceeded", retry_after=self._retry_after())
        if c.max_waiting_tokens is not None and self.num_waiting_tokens + num_tokens > c.max_waiting_tokens:
            raise RequestRejected(
                f"server is at capacity: {self.num_waiting_tokens} prompt tokens waiting "
                f"(limit {c.max_waiting_tokens})",
                status_code=429, code="rate_limit_exceeded", retry_after=self._retry_after())

    def _retry_after(self) -> float:
        return 1.0 + 0.05 * len(self.waiting)

    def accepting(self) -> bool:
        """Whether a new workflow is welcome now (`GET /load`); calls are still accepted either way,
        up to the waiting-queue bounds. See `admissible_workflows`."""
        return self.admissible_workflows() > 0

    def admissible_workflows(self) -> int:
        """How many new workflows are welcome now (`GET /load`): none when the waiting queue is at
        a bound, when calls wait for a sequence slot, when as many workflows as `workflow_limit`
        allows (fixed, or found by the engine: engine/admission.py) are in flight (a call
        running or waiting, or KV retained for the next; with `auto`, one more is welcome while
        the engine has nothing at all to compute), or when the KV cache cannot take
        one more call of typical size on top of the working set of the workflows already admitted
        (`kv_headroom`): a workflow admitted then would only displace the KV of those already
        running or waiting on a tool. Otherwise as many as fit one after another, each taking
        what a typical workflow reserves once it is in (its call up to max_tokens and its growth
        to a typical final size), and, below the prefill-backlog bound, no more than the room left
        under it holds typical first prompts (uncached tokens of workflows' first calls, a moving
        average), at least one: each new workflow's prompt is work every call behind it waits for.

        A count, not a yes/no, because a router (or `sluice bench --admission load`) cannot see
        its own admissions in `/load` until their calls arrive: admitting on every `accepting`
        answer meanwhile lets a burst of slots in at once (measured: 20 workflows in 0.1 s over
        HTTP, whose follow-up calls then lost their retained KV and waited 12-14 s)."""
        c = self.config
        if c.max_waiting_tokens is not None and self.num_waiting_tokens >= c.max_waiting_tokens:
            return 0
        if len(self.running) >= c.max_num_seqs and self.waiting:
            return 0
        # Past `admit_backlog_steps` token budgets of prompt tokens waiting, every step is already
        # full of prefill: a workflow admitted then adds no throughput, only queueing for every
        # call behind it.
        backlog_room = math.inf
        if c.admit_backlog_steps is not None:
            backlog_room = c.admit_backlog_steps * c.max_num_batched_tokens - self.prefill_backlog()
            if backlog_room <= 0:
                return 0
        room = self.workflow_limit.room(self.workflows.num_active, idle=not self.running and not self.waiting)
        if room is not None and room <= 0:
            return 0
        call = self.typical_call_blocks
        headroom = self.kv_headroom()
        if headroom < call:
            return 0
        n = 1 + (headroom - call) // max(call + self.typical_growth_blocks, self.typical_final_blocks)
        n = min(n, max(1, c.max_num_seqs - len(self.running) - len(self.waiting)))
        if c.max_waiting_requests is not None:
            n = min(n, c.max_waiting_requests - len(self.waiting))
        if room is not None:
            n = min(n, room)
        if backlog_room < math.inf:
            n = min(n, max(1, math.ceil(backlog_room / max(1.0, self.typical_first_prompt_tokens))))
        return max(0, n)

    def prefill_backlog(self) -> int:
        """Prompt tokens still to compute: running calls' prefill remainders and waiting calls'
        prompts beyond their prefix-cache hits. What a call arriving now queues behind (in FCFS
        order; the workflow policy puts a new workflow's first call near the front)."""
        backlog = sum(r.num_tokens - r.num_computed_tokens for r in self.running if not r.is_decode)
        for r in self.waiting:
            backlog += max(0, r.num_tokens - len(self._computed_blocks(r)) * self.block_size)
        return backlog

    def kv_headroom(self) -> int:
        """Blocks free (or evictable) beyond the admitted workflows' working set: what each call,
        running or waiting, needs to reach its max_tokens beyond the blocks it holds (a waiting
        call: beyond its workflow's retained prefix), and, for each workflow that will call again
        (retained between calls, or with a call not marked its last step), what it still lacks
        of a typical workflow's final size, and at least a typical call's growth. Without that
        last term the cache looks roomy exactly while the admitted workflows are between calls
        or early in their lives, and a workflow admitted then evicts their KV later (measured
        with benchmarks/engine_replay.py under pressure: prefix hits 63.9% -> 67.7% of an ideal
        72.4%, preemptions 39 -> 20, +7.6% throughput). A waiting call counts like a running one:
        a new workflow's first call is in the working set from the moment it arrives."""
        final, g = self.typical_final_blocks, self.typical_growth_blocks
        reserved = 0
        for r in self.running:
            at_max = self.kv.blocks_for(r.max_total_tokens)
            reserved += max(0, at_max - len(r.blocks))
            if r.has_named_workflow and not r.is_last_step:
                reserved += max(g, final - at_max)
        for r in self.waiting:
            at_max = self.kv.blocks_for(r.max_total_tokens)
            wf = self.workflows.workflows.get(r.workflow_id)
            if wf is not None and wf.retention is not None:
                reserved += max(0, at_max - len(wf.retention.blocks))  # its growth: below
            else:
                reserved += at_max
                if r.has_named_workflow and not r.is_last_step:
                    reserved += max(g, final - at_max)
        for wf in self.workflows.workflows.values():
            if wf.retention is not None:
                reserved += max(g, final - len(wf.retention.blocks))
        return self.pool.num_free_blocks - reserved

    def _observe_call_size(self, req: Request) -> None:
        def average(old: int, new: int) -> int:
            return round(0.9 * old + 0.1 * new)

        blocks = self.kv.blocks_for(req.num_tokens)
        self.typical_call_blocks = average(self.typical_call_blocks, blocks)
        if req.has_named_workflow and req.is_last_step:
            self.typical_final_blocks = average(self.typical_final_blocks, blocks)
        added = blocks - max(0, req.num_cached_tokens) // self.block_size
        self.typical_growth_blocks = max(1, average(self.typical_growth_blocks, added))

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Reject a request that can never fit the context or the KV cache."""
        limit = self.config.max_model_len
        if prompt_len + max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                status_code=400, code="context_length_exceeded", param="max_tokens")
        if self.kv.blocks_for(prompt_len + max_tokens) > self.pool.num_blocks:
            raise RequestRejected(
                f"request needs {prompt_len + max_tokens} tokens of KV cache; the cache holds "
                f"{self.pool.num_blocks * self.block_size}", status_code=400, code="context_length_exceeded")

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if not req.part_of_call:
            req.opens_workflow = self.open_call(req.workflow_id)
        self.waiting.append(req)

    def open_call(self, workflow_id: str) -> bool:
        """A call of the workflow arrived (the engine runs it as one request, or as several
        `part_of_call` ones); whether it is the workflow's first."""
        return self.workflows.on_call_arrival(workflow_id, self.clock()).calls == 1

    def close_call(self, workflow_id: str, named: bool, is_last_step: bool) -> None:
        """A call of the workflow ended (its KV already retained or freed): the client's last step
        ends the workflow's retention, and an anonymous call's workflow is forgotten."""
        if named and is_last_step:
            wf = self.workflows.workflows.get(workflow_id)
            if wf is not None:
                self.workflows.release(wf)
        self.workflows.on_call_finished(workflow_id, self.clock())
        if not named:
            self.workflows.forget_if_idle(workflow_id)   # an anonymous call is its own workflow

    def abort_request(self, request_id: str) -> Optional[Request]:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        if not req.is_finished:
            self._finish(req, status)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self.workflows.expire(now)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        taken: set[str] = set()
        self._prompts_closed = False

        order = sorted(self.running, key=lambda r: (0 if r.is_decode else 1, self.policy.priority(r, now)))
        decodes = [r for r in order if r.is_decode]
        prefills = order[len(decodes):]
        # While prompt tokens wait, the decodes may sit this step out (SchedulerConfig.decode_yield_steps).
        yielding = (bool(decodes) and (bool(self.waiting) or bool(prefills))
                    and self._decode_yields < self.config.decode_yield_steps)
        budget = self._schedule_running(out, prefills if yielding else order, budget, now, taken)
        if not out.preempted:
            budget = self._admit_waiting(out, budget, now, taken, busy=yielding)
        yielded = yielding and bool(out.scheduled)
        if yielding and not yielded:   # no prompt work could run after all: the decodes do not wait for nothing
            budget = self._schedule_running(out, decodes, budget, now, taken)
        self._decode_yields = self._decode_yields + 1 if yielded else 0
        self.decode_yield_steps_total += yielded
        if self.proposer is not None and budget > 0:
            budget = self._add_drafts(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if self.states is not None and self.pool.enable_caching and self.states.layout.num_snapshots:
            self._plan_snapshots(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, order: list[Request], budget: int, now: float,
                          taken: set[str]) -> int:
        """Give running requests (in `order`) their tokens from the budget, making room for them
        as the module docstring says; returns the budget left."""
        for req in order:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._prompts_closed and not req.is_decode:
                continue
            n = min(req.num_tokens_to_compute, budget)
            wait = False
            while not self.kv.allocate_slots(req, n):
                deficit = self.kv._num_new_blocks(req, n, ()) - self.pool.num_free_blocks
                if self.workflows.release_for(deficit, now) > 0:
                    continue
                fit = self.kv.num_free_slots(req) + self.pool.num_free_blocks * self.block_size
                if self.SHRINK_CHUNKS and 0 < fit < n:
                    n = fit  # a shorter chunk
                    continue
                if req.deferred_steps < self.MAX_DEFER_STEPS and self._others_can_progress(req):
                    req.deferred_steps += 1
                    wait = True
                    break
                victim = self._pick_victim(now)
                if victim.request_id in taken:
                    budget += self._untake(out, victim, taken)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING and not wait:
                req.deferred_steps = 0
                self._take(out, req, n, taken)
                budget -= n

        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float, taken: set[str],
                       busy: bool = False) -> int:
        """Admit waiting calls in policy order into the budget left. `busy`: the engine has work
        this step besides what is in `out` (decodes sitting the step out)."""
        self._count_held_blocks()
        order = sorted(self.waiting, key=lambda r: self.policy.priority(r, now))
        admitted: list[Request] = []
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or self._prompts_closed:
                break
            if self.states is not None and not self.states.num_free_seq_slots:
                break
            computed = self._computed_blocks(req)
            tail = self._retained_tail(req, computed)
            num_hit = len(computed) * self.block_size + tail
            n = min(req.num_tokens - num_hit, budget)
            if not self.kv.can_fit(req, n, computed, tail):
                own = self.workflows.workflows.get(req.workflow_id)
                if own is not None and own.retention is not None:
                    self.workflows.release(own)  # admission ends it anyway; its hits stay cached
                tail = 0                         # (but not its tail block, which was private)
                num_hit = len(computed) * self.block_size
                n = min(req.num_tokens - num_hit, budget)
                deficit = (self.kv._num_new_blocks(req, n, computed) + sum(1 for b in computed if b.ref_cnt == 0)
                           - self.pool.num_free_blocks)
                # A retention is kept against waiting work worth less than it, but never while
                # the engine would otherwise sit idle: then the waiting call's delay is unbounded.
                idle = not out.scheduled and not busy
                self.workflows.release_for(deficit, now, exclude=req.workflow_id,
                                           max_value=math.inf if idle else req.num_tokens)
                computed = self._computed_blocks(req)  # releases may have changed what is cached
                num_hit = len(computed) * self.block_size
                n = min(req.num_tokens - num_hit, budget)
                if not self.kv.can_fit(req, n, computed):
                    break  # strict priority order: later requests do not jump the blocked one
            if tail:
                handed = self.workflows.workflows[req.workflow_id].retention.take_tail()
                ok = self.kv.allocate_slots(req, n, computed, (handed, tail))
                assert ok, "can_fit said yes for the same request"
            else:
                self.kv.allocate_slots(req, n, computed)
            if self.states is not None:
                self._start_state(req, computed, out)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self.kv.record_lookup(req.num_prompt_tokens, min(num_hit, req.num_prompt_tokens))
                if req.opens_workflow:
                    self._first_prompts_seen += 1
                    w = max(0.1, 1.0 / self._first_prompts_seen)
                    new = req.num_prompt_tokens - min(num_hit, req.num_prompt_tokens)
                    self.typical_first_prompt_tokens += w * (new - self.typical_first_prompt_tokens)
            req.num_computed_tokens = num_hit
            wf = self.workflows.workflows.get(req.workflow_id)
            if wf is not None and wf.retention is not None:
                self.workflows.release(wf)  # the new call now holds its own references
            req.status = RequestStatus.RUNNING
            req.admit_time = req.admit_time or now
            self.running.append(req)
            admitted.append(req)
            self._take(out, req, n, taken)
            budget -= n
        if admitted:
            ids = {r.request_id for r in admitted}
            self.waiting = [r for r in self.waiting if r.request_id not in ids]
        return budget

    def _retained_tail(self, req: Request, computed: list) -> int:
        """How many leading tokens of the retained tail block of req's workflow continue req's
        prefix-cache hits (0: none, or no such block). The hits must be exactly the retention's
        full blocks, and at least one prompt token is left to compute (its logits are needed)."""
        if self.states is not None or not computed or req.needs_prompt_logprobs:
            return 0
        wf = self.workflows.workflows.get(req.workflow_id)
        r = wf.retention if wf is not None else None
        if r is None or not r.tail_tokens:
            return 0
        full = r.num_full_blocks
        if len(computed) != full or computed[-1] is not r.blocks[full - 1]:
            return 0
        start = full * self.block_size
        limit = min(len(r.tail_tokens), req.num_tokens - 1 - start)
        tokens = req.all_token_ids
        m = 0
        while m < limit and tokens[start + m] == r.tail_tokens[m]:
            m += 1
        return m

    def _propose(self, req: Request, max_k: int, prompt_step: bool) -> list[int]:
        """Drafts for a decode, at most `max_k`, its draft length (adaptive; capped in a step that
        carries prompt tokens) and no more than the request may still generate beyond the step's
        own token (max_tokens, the context length)."""
        if req.generator is not None:
            return []  # a seeded request's tokens must not depend on how much was speculated
        room = min(req.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens) - 1
        if self.spec_config.adaptive:
            room = min(room, self._draft_len(req))
            if prompt_step:
                room = min(room, START_DRAFTS)
        if req.spec_acceptance < LOW_ACCEPTANCE:
            room = min(room, 1)   # its drafts are mostly wrong: one, to notice when that changes
        return self.proposer.propose(req, min(max_k, room))

    def _draft_len(self, req: Request) -> int:
        if req.draft_len is None:
            req.draft_len = min(START_DRAFTS, self.spec_config.num_speculative_tokens)
        return req.draft_len

    def _adapt_draft_len(self, req: Request, drafted: int, accepted: int) -> None:
        """After a verification of `drafted` drafts that accepted `accepted` of them (see
        START_DRAFTS): longer only when the request was given its whole draft length."""
        k = self._draft_len(req)
        if accepted < drafted:
            req.draft_len = max(1, k - 1)
        elif drafted >= k:
            req.draft_len = min(self.spec_config.num_speculative_tokens, k + 2)

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Give this step's decodes drafts from the token budget left after everything else
        (in their scheduling order). A draft may take a new block only while more blocks are
        free than there are running requests; otherwise drafts fill the decode's last block."""
        prompt_step = any(not req.is_decode for req, _ in out.scheduled)
        for i, (req, n) in enumerate(out.scheduled):
            if budget <= 0:
                break
            if n != 1 or not req.is_decode:
                continue
            drafts = self._propose(req, budget, prompt_step)
            if not drafts:
                continue
            need = self.kv._num_new_blocks(req, 1 + len(drafts), ())
            if need > 0 and not (self.pool.num_free_blocks - need >= len(self.running)
                                 and self.kv.allocate_slots(req, 1 + len(drafts))):
                drafts = drafts[:len(req.blocks) * self.block_size - req.num_tokens]
                if not drafts:
                    continue
            out.scheduled[i] = (req, 1 + len(drafts))
            out.spec_tokens[req.request_id] = drafts
            budget -= len(drafts)
        return budget

    def _computed_blocks(self, req: Request) -> list:
        """Prefix-cache hits; for hybrid models only as deep as a state snapshot reaches, since
        the recurrent state at the end of the hit must be restored exactly."""
        hits = self.kv.get_computed_blocks(req)
        if req.needs_prompt_logprobs:  # positions skipped would have no logits
            hits = hits[:req.max_prompt_hit // self.block_size]
        if self.states is None:
            return hits
        n = len(hits)
        while n and not self.states.is_committed(req.block_hashes[n - 1][1]):
            n -= 1
        return hits[:n]

    def _start_state(self, req: Request, computed: list, out: SchedulerOutput) -> None:
        req.state_slot = self.states.allocate()
        src = self.states.lookup(req.block_hashes[len(computed) - 1][1]) if computed else None
        out.state_inits.append((req.state_slot, src))

    def _plan_snapshots(self, out: SchedulerOutput) -> None:
        """Snapshot each scheduled request's state at the last block boundary its chunk reaches,
        unless that prefix already has one (or is about to)."""
        bs = self.block_size
        for req, n in out.scheduled:
            c = req.num_computed_tokens
            boundary = (c + n) // bs * bs
            if boundary <= c:
                continue
            self.kv.update_block_hashes(req)
            key = req.block_hashes[boundary // bs - 1][1]
            if self.states.has(key):
                continue
            slot = self.states.reserve(key)
            if slot is not None:
                out.state_saves[req.request_id] = (boundary - c, slot)

    def _release_state(self, req: Request) -> None:
        if req.state_slot is not None:
            self.states.free(req.state_slot)
            req.state_slot = None

    def _count_held_blocks(self) -> None:
        """Refresh each workflow's `num_blocks_held` (blocks of its running calls) for the policy."""
        wfs = self.workflows.workflows
        for wid in self._held_workflows:
            if wid in wfs:
                wfs[wid].num_blocks_held = 0
        self._held_workflows = set()
        for r in self.running:
            wf = wfs.get(r.workflow_id)
            if wf is not None and r.blocks:
                wf.num_blocks_held += len(r.blocks)
                self._held_workflows.add(r.workflow_id)

    def _take(self, out: SchedulerOutput, req: Request, n: int, taken: set[str]) -> None:
        out.scheduled.append((req, n))
        completes = req.num_computed_tokens + n == req.num_tokens
        out.samples.append(completes)
        taken.add(req.request_id)
        close = self.config.close_step_tokens
        if (close is not None and completes and req.num_output_tokens == 0
                and sum(k for _, k in out.scheduled) >= close):
            self._prompts_closed = True   # this call's first token comes at this step's end

    def _others_can_progress(self, req: Request) -> bool:
        """Whether another running request has a free slot in its own blocks (it computes this
        step without taking one), so a step without `req` is not an empty step."""
        return any(r is not req and r.status is RequestStatus.RUNNING and self.kv.num_free_slots(r) > 0
                   for r in self.running)

    def _pick_victim(self, now: float) -> Request:
        """Lowest priority running request, the one asking for blocks included (it yields rather
        than evict a more important one) and ones already scheduled this step (withdrawn);
        least progress lost on ties; protected (just resumed, no progress yet) requests only
        when nothing else is left."""
        cands = [r for r in self.running if not r.protected] or self.running
        return max(cands, key=lambda r: (self.policy.priority(r, now), -r.num_computed_tokens))

    @staticmethod
    def _untake(out: SchedulerOutput, req: Request, taken: set[str]) -> int:
        """Withdraw `req`'s entry from this step's output; returns the tokens it had."""
        i = next(i for i, (r, _) in enumerate(out.scheduled) if r is req)
        _, n = out.scheduled.pop(i)
        out.samples.pop(i)
        taken.discard(req.request_id)
        return n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        if self.states is not None:
            self._release_state(req)  # recomputed on resumption: a fresh (or snapshot) state
        req.num_computed_tokens = 0
        req.deferred_steps = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.protected = True
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.append(req)
        out.preempted.append(req)

    # --- results ------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: list[int | list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens and apply token-level stops. `sampled`
        has one entry per sampling entry, in order: a token, or the list of tokens the step
        yielded for it (a verified speculation: its accepted drafts, then one sampled token).
        Returns the requests that received tokens; `req.num_new_tokens` says how many."""
        now = self.clock()
        if self.states is not None:
            self.states.commit_pending()  # the step wrote its planned snapshots
        updated = []
        it = iter(sampled)
        for (req, n), samples in zip(out.scheduled, out.samples):
            toks = next(it) if samples else None
            if req.is_finished or req.status is not RequestStatus.RUNNING:
                continue
            drafts = out.spec_tokens.get(req.request_id)
            if toks is not None and not isinstance(toks, list):
                toks = [toks]
            if drafts is not None:
                assert toks and len(toks) <= len(drafts) + 1 and toks[:-1] == drafts[:len(toks) - 1], (toks, drafts)
                self.spec_drafts_total += 1
                self.spec_draft_tokens_total += len(drafts)
                self.spec_accepted_tokens_total += len(toks) - 1
                if req.drafted_from_prediction:
                    req.prediction_accepted += len(toks) - 1
                rate = (len(toks) - 1) / len(drafts)
                req.spec_acceptance = 0.7 * req.spec_acceptance + 0.3 * rate
                if self.spec_config.adaptive:
                    self._adapt_draft_len(req, len(drafts), len(toks) - 1)
                n = len(toks)   # the step's input token and the accepted drafts have valid KV
            else:
                assert toks is None or len(toks) == 1, "several tokens for an entry without drafts"
            req.num_computed_tokens += n
            wf = self.workflows.workflows.get(req.workflow_id)
            if wf is not None:
                wf.service += n
                wf.last_activity = now
            if req.num_output_tokens == 0:
                self.prompt_tokens_total += n
            if toks is None:
                self.kv.cache_computed_blocks(req)
                continue
            req.protected = False
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            updated.append(req)
            req.num_new_tokens = 0
            status = None
            for tok in toks:
                req.append_output_token(tok)
                req.num_new_tokens += 1
                self.generation_tokens_total += 1
                status = req.check_stop(self.config.max_model_len)
                if status is not None:
                    break
            # A stop inside the accepted run: every remaining token was computed.
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self.kv.cache_computed_blocks(req)
            if status is not None:
                self._finish(req, status)
            elif drafts is not None:
                self.kv.trim(req)
        return updated

    def _finish(self, req: Request, status: RequestStatus) -> None:
        now = self.clock()
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if self.states is not None:
            self._release_state(req)
        retain = req.has_named_workflow and not req.is_last_step and status.completed and not req.part_of_call
        if retain and req.num_cached_blocks > 0:
            blocks = self.kv.take_blocks(req)
            full = self._cached_prefix_len(blocks)
            computed = min(req.num_computed_tokens, req.num_tokens)   # tokens with valid KV
            tail: tuple[int, ...] = ()
            if (self.states is None and full == computed // self.block_size and computed % self.block_size
                    and len(blocks) > full):
                tail = tuple(req.all_token_ids[full * self.block_size:computed])
            keep = blocks[:full + (1 if tail else 0)]
            self.pool.free(reversed(blocks[len(keep):]))
            self.workflows.retain(req.workflow_id, keep, full * self.block_size + len(tail), now, tail)
        else:
            self.kv.free(req)
        if not req.part_of_call:   # a call run as several requests ends with the engine's close_call
            if status.completed:
                self._observe_call_size(req)
            self.close_call(req.workflow_id, req.has_named_workflow, req.is_last_step)
        self.requests.pop(req.request_id, None)

    @staticmethod
    def _cached_prefix_len(blocks) -> int:
        n = 0
        for b in blocks:
            if b.hash_key is None:
                break
            n += 1
        return n

    # --- observability ------------------------------------------------------------------
    def stats(self, engine_stalls: int = 0) -> EngineStats:
        """The snapshot; `engine_stalls` is the engine's own count (LLMEngine's stall guard)."""
        # Disjoint: used (referenced by a call), retained (by retentions only), evictable, free.
        retained = self.workflows.num_blocks_only_retained()
        free = self.pool.num_free_blocks
        evictable = self.pool.num_evictable_blocks
        used = self.pool.num_blocks - free - retained
        st = self.states
        active = self.workflows.active_ids()
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_tokens=self.num_waiting_tokens,
            kv_blocks_total=self.pool.num_blocks,
            kv_blocks_used=used,
            kv_blocks_retained=retained,
            kv_blocks_evictable=evictable,
            kv_blocks_free=free - evictable,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            spec_drafts_total=self.spec_drafts_total,
            spec_draft_tokens_total=self.spec_draft_tokens_total,
            spec_accepted_tokens_total=self.spec_accepted_tokens_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_workflows=len(self.workflows.workflows),
            admissible_workflows=self.admissible_workflows(),
            decode_yield_steps=self.decode_yield_steps_total,
            active_workflows=len(active),
            active_workflow_ids=active,
            max_active_workflows=self.workflow_limit.value,
            engine_overhead=self.workflow_limit.last_overhead,
            engine_step_ratio=self.workflow_limit.last_step_ratio,
            engine_stalls=engine_stalls,
            state_slots_total=st.layout.num_seq_slots if st else 0,
            state_slots_used=st.num_held if st else 0,
            state_snapshots_total=st.layout.num_snapshots if st else 0,
            state_snapshots_used=st.num_snapshots if st else 0,
        )

    def check_invariants(self) -> None:
        """Every block's references are accounted for by requests and retentions."""
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for r in self.running + self.waiting:
            for b in r.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for wf in self.workflows.workflows.values():
            if wf.retention:
                for b in wf.retention.blocks:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs.get(b.block_id, 0)} holders")
        if self.states is not None:
            assert all(r.state_slot is None for r in self.waiting), "a waiting request holds a state slot"
            self.states.check_invariants([r.state_slot for r in self.running])
