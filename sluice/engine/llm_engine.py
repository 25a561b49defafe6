"""The synchronous engine: add requests, then `step()` until they finish.

`step()` reads top to bottom as the request's path: schedule, run the model, update the
scheduler with the sampled tokens, turn tokens into text and outputs.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from sluice.attention import create_backend
from sluice.config import EngineConfig
from sluice.engine.admission import StepShape
from sluice.engine.bad_words import BadWords, bad_words_token_ids
from sluice.engine.beam_search import BeamSearch
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.errors import RequestRejected
from sluice.engine.cache_plan import plan_for
from sluice.engine.model_runner import ModelRunner
from sluice.engine.request import Request, RequestStatus
from sluice.engine.scheduler import Scheduler, SchedulerOutput
from sluice.engine.stats import EngineStats
from sluice.engine.structured_output import GrammarCompiler
from sluice.engine.thinking import ThinkingTags, ThoughtTracker
from sluice.model.loader import load_model, load_tokenizer
from sluice.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import STREAM_FINAL_ONLY, SamplingParams
from sluice.tokenizer import Tokenizer

logger = logging.getLogger("sluice.engine")


@dataclass
class WorkflowInfo:
    workflow_id: Optional[str] = None   # None: the call is its own workflow
    is_last_step: bool = False          # the client says the workflow ends with this call


@dataclass
class _Sample:
    """One of a request's n sequences, with its text state and what was not yet reported."""

    req: Request
    detok: IncrementalDetokenizer
    logprobs: Optional[list[dict[int, Logprob]]]
    cumulative_logprob: Optional[float]
    delta_text: str = ""
    delta_tokens: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


@dataclass
class _Group:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[_Sample]
    arrival_time: float
    reported_finished: bool = False
    error: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    stream_interval: int = 1           # outputs carry this many new tokens, save the first and last
    sent: bool = False                 # an output with tokens has gone out
    ended: bool = False                # a sample finished since the last output
    token_times: list[float] = field(default_factory=list)   # steps that gave it tokens, not yet output


@dataclass
class _BeamGroup:
    """A beam search request (engine/beam_search.py): each step runs its live beams as one-token
    requests of their own (`part_of_call`), which share the prompt and the beams' common
    prefixes through the prefix cache; the call counts once for its workflow."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    search: BeamSearch
    workflow: WorkflowInfo
    workflow_key: str                  # the workflow the call counts for (its own id when anonymous)
    step_params: SamplingParams        # a beam's one-token request: greedy, with its top logprobs
    opens_workflow: bool = False
    children: list[Request] = field(default_factory=list)        # the current step's, by beam
    entries: dict[int, dict[int, Logprob]] = field(default_factory=dict)   # beam -> its next tokens
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list] = None
    metrics: dict = field(default_factory=dict)


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic,
                 tokenizer: Optional[Tokenizer] = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        self.clock = clock
        # Called with each step's schedule right after its forward, before the step's results
        # are applied (benchmarks/engine_replay.py --virtual-clock advances its clock there).
        self.step_hook: Optional[Callable[[SchedulerOutput], None]] = None
        # What the auto bound times steps with (the virtual-clock replay sets its own clock).
        self.step_timer: Callable[[], float] = time.perf_counter
        path = config.model_path
        from pathlib import Path

        self.tokenizer = tokenizer or load_tokenizer(Path(path), config.chat_template)
        plan = plan_for(config)   # before loading: a budget that cannot work fails at once
        num_blocks = plan.num_blocks
        capacity = num_blocks * config.cache.block_size
        if config.scheduler.max_model_len > capacity:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, less than max_model_len "
                f"{config.scheduler.max_model_len}; raise --kv-cache-tokens/--kv-cache-gib or lower --max-model-len")
        if plan.state is not None:
            logger.info("KV cache: %d blocks (%.2f GiB) + %d state slots + %d snapshots of %.1f MiB (%.2f GiB)",
                        num_blocks, plan.paged_bytes / (1 << 30), plan.state.num_seq_slots,
                        plan.state.num_snapshots, plan.bytes_per_state / (1 << 20), plan.state_bytes / (1 << 30))
        t0 = time.perf_counter()
        model = load_model(Path(path), config.model, config.dtype, create_backend(config.attention_backend),
                           huge_pages=config.huge_pages, weight_format=config.weight_format)
        logger.info("loaded %s (%s) in %.1fs", path, config.model.architecture, time.perf_counter() - t0)
        self.cache_plan = plan
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, clock, plan.state,
                                   speculative=config.speculative)
        if config.speculative is not None and plan.state is not None:
            logger.info("speculative decoding is off: %s has recurrent layers", config.model.architecture)
        self.runner = ModelRunner(config, model, num_blocks, plan.state)
        self.eos_token_ids = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + config.model.eos_token_ids))
        self.vocab_size = config.model.vocab_size
        # A thinking model's tags as tokens (None: the engine was not told them): thinking budgets, and
        # where a constrained reply's grammar starts (engine/thinking.py).
        self.thinking_tags = ThinkingTags.from_config(config.reasoning, self.tokenizer) if config.reasoning else None
        self.grammars = GrammarCompiler(self.tokenizer.info.tokenizer_json, self.vocab_size, self.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, str] = {}
        self._beams: dict[str, _BeamGroup] = {}
        self._beam_of_child: dict[str, tuple[_BeamGroup, int]] = {}
        self._pending: list[RequestOutput] = []   # outputs produced outside a step (aborts)
        self._stalled_since: Optional[float] = None  # first of the current run of steps that scheduled nothing
        self.num_stalls = 0                            # times unfinished requests were failed for it
        self._trace = open(config.step_trace_path, "a", buffering=1) if config.step_trace_path else None

    # --- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    workflow: Optional[WorkflowInfo] = None, arrival_time: Optional[float] = None) -> None:
        """Accept a request or raise RequestRejected (nothing is changed then)."""
        if request_id in self._groups or request_id in self._beams:
            raise RequestRejected(f"duplicate request id {request_id!r}")
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ()), ("prediction", params.prediction or ())):
            if any(t >= self.vocab_size for t in ids):
                raise RequestRejected(f"{name} token ids must be in [0, {self.vocab_size})", param=name)
        prompt_len = len(prompt_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.scheduler.max_model_len - prompt_len
            if max_tokens < 1:
                self.scheduler.check_fits(prompt_len, 1)
        self.scheduler.check_fits(prompt_len, max_tokens)
        if params.use_beam_search:   # one request waits; its beams' requests are the call's own
            self.scheduler.check_admission(1, prompt_len)
            self._add_beam_search(request_id, list(prompt_token_ids), params, max_tokens, workflow, arrival_time)
            return
        self.scheduler.check_admission(params.n, params.n * prompt_len)
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.grammars.compile(params.structured_outputs)  # cached when the server checked it
            except ValueError as e:
                raise RequestRejected(str(e), param="structured_outputs") from e

        bad_words = None
        if params.bad_words:
            try:
                bad_words = BadWords(bad_words_token_ids(self.tokenizer, params.bad_words))
            except ValueError as e:
                raise RequestRejected(str(e), param="bad_words") from e
            if params.allowed_token_ids is not None and set(params.allowed_token_ids) <= {
                    seq[0] for seq in bad_words.seqs if len(seq) == 1}:
                raise RequestRejected("bad_words bans every one of allowed_token_ids", param="bad_words")

        budget = params.thinking_token_budget
        if budget is not None and self.thinking_tags is None:
            raise RequestRejected("thinking_token_budget needs the model's thinking tags: start the server with "
                                  "--reasoning-parser (or --reasoning-config)", param="thinking_token_budget")
        # The reply's thought is tracked for its budget, and for its grammar, which starts where
        # the thought closes: one the prompt opens, or one the reply opens with its first token
        # where the start tag is one token. Otherwise a constrained reply has no thought.
        thought = None
        if self.thinking_tags is not None and (budget is not None or grammar is not None):
            thought = ThoughtTracker(self.thinking_tags, budget, prompt_token_ids)
            if grammar is not None and not thought.may_think:
                thought = None

        now = arrival_time if arrival_time is not None else self.clock()
        workflow = workflow or WorkflowInfo()
        samples = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            generator = None
            if params.seed is not None:
                generator = torch.Generator().manual_seed(params.seed + i)
            req = Request(child_id, prompt_token_ids, params, max_tokens, now, self.eos_token_ids,
                          workflow.workflow_id, workflow.is_last_step, generator,
                          grammar.new_state() if grammar is not None else None, bad_words,
                          copy.copy(thought) if thought is not None else None)   # a state per sample
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                           params.stop, params.include_stop_str_in_output)
            want_lp = params.logprobs is not None
            samples.append(_Sample(req, detok, [] if want_lp else None, 0.0 if want_lp else None))
        for s in samples:
            self._child_to_group[s.req.request_id] = request_id
        interval = max(self.config.stream_interval, params.stream_interval or 1)
        self._groups[request_id] = _Group(request_id, list(prompt_token_ids), samples, now,
                                          metrics={"arrival_time": now}, stream_interval=interval)
        for s in samples:
            self.scheduler.add_request(s.req)

    def _add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         max_tokens: int, workflow: Optional[WorkflowInfo], arrival_time: Optional[float]) -> None:
        workflow = workflow or WorkflowInfo()
        search = BeamSearch(len(prompt_token_ids), params, max_tokens, self.eos_token_ids)
        step_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                     logprobs=max(search.num_candidates, params.logprobs or 0),
                                     cache_salt=params.cache_salt, priority=params.priority,
                                     stream_interval=STREAM_FINAL_ONLY)
        now = arrival_time if arrival_time is not None else self.clock()
        key = workflow.workflow_id if workflow.workflow_id is not None else request_id
        group = _BeamGroup(request_id, prompt_token_ids, params, search, workflow, key, step_params,
                           metrics={"arrival_time": now})
        group.opens_workflow = self.scheduler.open_call(key)
        self._beams[request_id] = group
        self._start_beam_step(group)

    def _start_beam_step(self, group: _BeamGroup) -> None:
        now = self.clock()
        step = group.search.steps
        group.children, group.entries = [], {}
        for i, beam in enumerate(group.search.beams):
            params = group.step_params
            if step == 0 and group.params.prompt_logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=group.params.prompt_logprobs)
            req = Request(f"{group.request_id}@{step}.{i}", group.prompt_token_ids + beam.token_ids, params, 1, now,
                          workflow_id=group.workflow_key, is_last_step=group.workflow.is_last_step)
            req.has_named_workflow = group.workflow.workflow_id is not None
            req.part_of_call = True
            req.opens_workflow = group.opens_workflow and step == 0
            group.children.append(req)
            self._beam_of_child[req.request_id] = (group, i)
            self.scheduler.add_request(req)

    def _beam_token(self, req: Request, logprobs: dict[str, list[dict[int, Logprob]]]) -> Optional[RequestOutput]:
        """A beam's one-token request ended: the step advances once every beam's has; the
        search's output when it is done."""
        group, i = self._beam_of_child.pop(req.request_id)
        if req.error is not None or req.request_id not in logprobs:
            return self._end_beam_search(group, "error", req.error or "a beam's step produced no logprobs")
        group.entries[i] = logprobs[req.request_id][0]
        if group.search.steps == 0 and i == 0:
            group.num_cached_tokens = max(0, req.num_cached_tokens)
            group.prompt_logprobs = req.prompt_logprobs
            group.metrics["scheduled_time"] = req.admit_time
            group.metrics["first_token_time"] = req.first_token_time
        if len(group.entries) < len(group.children):
            return None
        group.search.advance([group.entries[b] for b in range(len(group.children))])
        if group.search.done:
            return self._end_beam_search(group, "length")
        self._start_beam_step(group)
        return None

    def _end_beam_search(self, group: _BeamGroup, finish_reason: str, error: Optional[str] = None) -> RequestOutput:
        """The search's output; its unfinished beam requests (an abort, an error) end."""
        for req in group.children:
            if self._beam_of_child.pop(req.request_id, None) is not None:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED)
        self._beams.pop(group.request_id, None)
        self.scheduler.close_call(group.workflow_key, group.workflow.workflow_id is not None,
                                  group.workflow.is_last_step)
        params = group.params
        outs = []
        for index, beam in enumerate(group.search.best(finish_reason)):
            text_ids = beam.token_ids[:-1] if beam.ended_by_token else beam.token_ids
            text = self.tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens) if text_ids else ""
            outs.append(CompletionOutput(
                index=index, text=text, token_ids=list(beam.token_ids), cumulative_logprob=beam.cumulative_logprob,
                logprobs=beam.logprobs[:len(beam.token_ids)] if params.logprobs is not None else None,
                finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
                text_delta=text, num_new_tokens=len(beam.token_ids)))
        now = self.clock()
        group.metrics["finish_time"] = now
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, True,
                             num_cached_tokens=group.num_cached_tokens, error=error, metrics=dict(group.metrics),
                             prompt_logprobs=group.prompt_logprobs, token_times=[now])

    def abort_request(self, request_id: str) -> None:
        beams = self._beams.get(request_id)
        if beams is not None:
            self._pending.append(self._end_beam_search(beams, "abort"))
            return
        group = self._groups.get(request_id)
        if group is None:
            return
        for s in group.samples:
            self.scheduler.abort_request(s.req.request_id)
            s.finish_reason = s.finish_reason or "abort"
        self._pending.append(self._make_output(group))

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with the error `message`; their outputs."""
        outs = [self._end_beam_search(g, "error", message) for g in list(self._beams.values())]
        for group in list(self._groups.values()):
            group.error = message
            for s in group.samples:
                self.scheduler.finish_request(s.req, RequestStatus.FINISHED_ERROR)
                s.finish_reason = s.finish_reason or "error"
            outs.append(self._make_output(group))
        return outs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def _check_stall(self) -> list[RequestOutput]:
        """Called on a step that scheduled nothing. That is normal for a moment (the last running
        request just finished), but while requests are unfinished it must not last: with nothing
        running, an idle engine gives a waiting call every block it needs (retentions included), and
        running requests always get their tokens or make room by preemption. Steps that schedule
        nothing for `stall_timeout_s` are therefore a scheduler fault; the unfinished requests end
        with an error (a 500 at the server) instead of hanging their clients, the scheduler's
        state is logged, and the engine goes on with the requests that come next."""
        if not self.scheduler.has_unfinished():
            self._stalled_since = None
            return []
        now = self.clock()
        if self._stalled_since is None:
            self._stalled_since = now
        if now - self._stalled_since < self.config.stall_timeout_s:
            return []
        sch = self.scheduler
        logger.error("the scheduler made no progress for %.0f s with %d requests running and %d waiting "
                     "(%d of %d KV blocks free, %d workflows retaining KV); failing them",
                     now - self._stalled_since, len(sch.running), len(sch.waiting), sch.pool.num_free_blocks,
                     sch.pool.num_blocks, sum(1 for wf in sch.workflows.workflows.values() if wf.retention))
        self._stalled_since = None
        self.num_stalls += 1
        return self.fail_all(f"the engine could not schedule this request for {self.config.stall_timeout_s:.0f} s "
                             "(a scheduler fault, logged by the server)")

    def stats(self) -> EngineStats:
        return self.scheduler.stats(engine_stalls=self.num_stalls)

    # --- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = self.step_timer()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched.empty:
            outputs.extend(self._check_stall())
            return outputs
        self._stalled_since = None
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        t1 = time.perf_counter()
        if self.step_hook is not None:
            self.step_hook(sched)
        if result.prompt_logprobs:
            for req, _ in sched.scheduled:
                if req.request_id in result.prompt_logprobs:
                    req.prompt_logprobs.extend(result.prompt_logprobs[req.request_id])
        logprobs = self._logprobs_by_request(sched, result.logprobs)
        updated = self.scheduler.update_from_output(sched, result.sampled_token_ids)
        outputs.extend(self._process(updated, logprobs))
        limit = self.scheduler.workflow_limit
        if self._trace is not None or limit.auto:
            dec, pre = self._split(sched)
            if limit.auto:
                limit.observe_step(start, self.step_timer(), self._shape(sched, dec, pre),
                                   self.scheduler.workflows.num_active)
            if self._trace is not None:
                self._trace_step(sched, dec, pre, t0, t1)
        return outputs

    @staticmethod
    def _split(sched: SchedulerOutput) -> tuple[list[Request], list[tuple[Request, int]]]:
        """The step's decodes (with or without drafts) and its prefill chunks."""
        spec = sched.spec_tokens
        dec = [r for r, n in sched.scheduled if n == 1 or r.request_id in spec]
        pre = [(r, n) for r, n in sched.scheduled if n != 1 and r.request_id not in spec]
        return dec, pre

    @staticmethod
    def _shape(sched: SchedulerOutput, dec: list[Request], pre: list[tuple[Request, int]]) -> StepShape:
        # A chunk of n tokens after c computed ones attends to c + n/2 tokens on average. A
        # prompt chunk that samples is its prompt's last.
        spec = sched.spec_tokens
        return StepShape(rows=len(dec) + sum(len(d) for d in spec.values()),
                         prompt_tokens=sum(n for _, n in pre),
                         prompt_attn=sum(n * (r.num_computed_tokens + n / 2) for r, n in pre) / 1e3,
                         decode_ctx=sum(r.num_computed_tokens for r in dec) / 1e3,
                         prompts_done=sum(1 for (r, n), samples in zip(sched.scheduled, sched.samples)
                                          if samples and n != 1 and r.request_id not in spec))

    def _trace_step(self, sched: SchedulerOutput, dec: list[Request], pre: list[tuple[Request, int]],
                    t0: float, t1: float) -> None:
        """One JSON line per step (`step_trace_path`): its shape, and where its time went."""
        spec = sched.spec_tokens
        rec = {
            "t": round(t0, 4), "forward_ms": round((t1 - t0) * 1e3, 2),
            "post_ms": round((time.perf_counter() - t1) * 1e3, 2),
            "decodes": len(dec), "decode_ctx": sum(r.num_computed_tokens for r in dec),
            "draft_tokens": sum(len(d) for d in spec.values()),
            "prefills": len(pre), "prefill_tokens": sum(n for _, n in pre),
            "prefill_ctx": sum(r.num_computed_tokens for r, _ in pre),
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            # after the step: prompt tokens still to compute, and workflows in flight
            "backlog": self.scheduler.prefill_backlog(), "workflows": self.scheduler.workflows.num_active,
            "limit": self.scheduler.workflow_limit.value,
            "ids": [[r.request_id, n] for r, n in sched.scheduled],
        }
        self._trace.write(json.dumps(rec) + "\n")

    @staticmethod
    def _logprobs_by_request(sched, logprobs) -> dict[str, list[dict[int, Logprob]]]:
        if logprobs is None:
            return {}
        sampling = [req.request_id for (req, _), s in zip(sched.scheduled, sched.samples) if s]
        return {rid: lp for rid, lp in zip(sampling, logprobs) if lp is not None}

    def _process(self, updated: list[Request], logprobs: dict[str, list[dict[int, Logprob]]]) -> list[RequestOutput]:
        touched: dict[str, _Group] = {}
        ended: list[RequestOutput] = []
        for req in updated:
            if req.part_of_call:
                out = self._beam_token(req, logprobs)
                if out is not None:
                    ended.append(out)
                continue
            gid = self._child_to_group[req.request_id]
            group = self._groups[gid]
            sample = next(s for s in group.samples if s.req is req)
            new = req.output_token_ids[-req.num_new_tokens:]
            lps = logprobs.get(req.request_id)
            delta, stop_str = "", None
            for i, tok in enumerate(new):
                d, stop_str = sample.detok.add_tokens([tok])
                delta += d
                sample.delta_tokens += 1
                if sample.logprobs is not None and lps is not None:
                    sample.logprobs.append(lps[i])
                    sample.cumulative_logprob += lps[i][tok].logprob
                if stop_str is not None:
                    req.drop_output_tail(len(new) - i - 1)
                    break
            if stop_str is not None:
                if req.is_finished:   # also hit a token-level stop; the stop string came first
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop_str
            elif req.is_finished:
                delta += sample.detok.flush()
                if sample.detok.stop_reason is not None:
                    req.stop_reason = sample.detok.stop_reason
                    req.status = RequestStatus.FINISHED_STOPPED
            sample.delta_text += delta
            if req.error is not None:
                group.error = req.error
            if req.is_finished:
                sample.finish_reason = req.status.value
                sample.stop_reason = req.stop_reason
                group.ended = True
            if "first_token_time" not in group.metrics:
                group.metrics["scheduled_time"] = req.admit_time
                group.metrics["first_token_time"] = req.first_token_time
            touched[gid] = group
        now = self.clock()
        for g in touched.values():
            g.token_times.append(now)
        return ended + [self._make_output(g) for g in touched.values() if self._due(g)]

    @staticmethod
    def _due(group: _Group) -> bool:
        """Whether a group's output goes out this step: always at stream interval 1; else its
        first tokens, a sample's end or an error at once, and otherwise once some sample holds
        `stream_interval` tokens not yet sent (vLLM's rule)."""
        if group.stream_interval == 1 or not group.sent or group.ended or group.error is not None:
            group.sent, group.ended = True, False
            return True
        return any(s.delta_tokens >= group.stream_interval for s in group.samples)

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        predicted = len(group.samples[0].req.params.prediction or ())
        for i, s in enumerate(group.samples):
            outs.append(CompletionOutput(
                index=i,
                text=s.detok.text,
                token_ids=list(s.req.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                text_delta=s.delta_text,
                num_new_tokens=s.delta_tokens,
                accepted_prediction_tokens=s.req.prediction_accepted if predicted else None,
                rejected_prediction_tokens=max(0, predicted - s.req.prediction_accepted) if predicted else None,
            ))
            s.delta_text, s.delta_tokens = "", 0
        finished = all(s.finish_reason is not None for s in group.samples)
        cached = max(0, min(s.req.num_cached_tokens for s in group.samples))
        if finished:
            group.metrics["finish_time"] = self.clock()
            self._groups.pop(group.request_id, None)
            for s in group.samples:
                self._child_to_group.pop(s.req.request_id, None)
        prompt_lps = next((s.req.prompt_logprobs for s in group.samples
                           if s.req.prompt_logprobs is not None and not s.req.needs_prompt_logprobs), None)
        times, group.token_times = group.token_times, []
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, finished,
                             num_cached_tokens=cached, error=group.error, metrics=dict(group.metrics),
                             prompt_logprobs=prompt_lps, token_times=times)
