"""Helpers for scheduler and cache tests: a fake clock, hand-built requests, and a step that plays
the model's part with hand-chosen tokens (in the style of vLLM's `tests/v1/core/utils.py`)."""
from __future__ import annotations

import itertools
from typing import Callable, Optional, Sequence

from sluice.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from sluice.engine.request import Request
from sluice.engine.scheduler import Scheduler, SchedulerOutput
from sluice.sampling_params import RepetitionDetectionParams, SamplingParams

EOS = 2          # the eos id every test request carries
TOKEN = 7        # a token that stops nothing

_prompt_ids = itertools.count(1000)


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def create_scheduler(
    *,
    block_size: int = 16,
    num_blocks: int = 1000,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 64,
    max_model_len: int = 8192,
    policy: str = "fcfs",
    enable_prefix_caching: bool = True,
    retention_ttl_s: float = 10.0,
    aging_s: float = 5.0,
    max_waiting_requests: Optional[int] = None,
    max_waiting_tokens: Optional[int] = None,
    speculative: Optional[SpeculativeConfig] = None,
    starvation_s: Optional[float] = None,
    admit_backlog_steps: Optional[float] = 2.0,
    decode_yield_steps: int = SchedulerConfig.decode_yield_steps,
    max_active_workflows=None,
    auto_overhead_band: Optional[tuple[float, float]] = None,
    close_step_tokens: Optional[int] = None,
) -> Scheduler:
    """A scheduler over a real BlockPool, driven by a FakeClock (`scheduler.clock`)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
        max_waiting_requests=max_waiting_requests,
        max_waiting_tokens=max_waiting_tokens,
        retention_ttl_s=retention_ttl_s,
        aging_s=aging_s,
        starvation_s=starvation_s,
        admit_backlog_steps=admit_backlog_steps,
        decode_yield_steps=decode_yield_steps,
        max_active_workflows=max_active_workflows,
        auto_overhead_band=auto_overhead_band,
        close_step_tokens=close_step_tokens,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, cache, num_blocks, clock=FakeClock(), speculative=speculative)


def unique_prompt(n: int) -> list[int]:
    """n token ids no other prompt from this helper shares (ids stay clear of EOS and TOKEN)."""
    base = next(_prompt_ids) * 10_000
    return [base + i for i in range(n)]


def create_request(
    scheduler: Scheduler,
    request_id: str,
    prompt: Sequence[int] | int = 10,
    *,
    max_tokens: int = 16,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: Sequence[int] = (),
    workflow_id: Optional[str] = None,
    is_last_step: bool = False,
    arrival_time: Optional[float] = None,
    add: bool = True,
    cache_salt: Optional[str] = None,
    priority: int = 0,
    repetition_detection: Optional[RepetitionDetectionParams] = None,
) -> Request:
    """A request with `prompt` tokens (a count gives a unique prompt), added to the scheduler."""
    tokens = unique_prompt(prompt) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=list(stop_token_ids), cache_salt=cache_salt,
                            priority=priority, repetition_detection=repetition_detection)
    req = Request(request_id, tokens, params, max_tokens,
                  arrival_time if arrival_time is not None else scheduler.clock(),
                  eos_token_ids=(EOS,), workflow_id=workflow_id, is_last_step=is_last_step)
    if add:
        scheduler.add_request(req)
    return req


def create_requests(scheduler: Scheduler, num_requests: int, prompt: Sequence[int] | int = 10,
                    prefix: str = "r", **kwargs) -> list[Request]:
    return [create_request(scheduler, f"{prefix}{i}", prompt, **kwargs) for i in range(num_requests)]


TokenFn = Callable[[Request], int]
MAX_IDLE_STEPS = 1000   # consecutive empty steps with work unfinished: the scheduler is stuck


def constant(req: Request) -> int:
    return TOKEN


AcceptFn = Callable[[Request, list[int]], int]


def run_step(scheduler: Scheduler, token_fn: TokenFn = constant,
             accept_fn: Optional[AcceptFn] = None) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step without a model: schedule, then one token per sampling entry, chosen by
    `token_fn(request)`; an entry verifying drafts yields its first `accept_fn(request, drafts)`
    drafts (default: all) and then that token. Checks the scheduler's invariants before returning."""
    out = scheduler.schedule()
    # A scheduler that stops making progress fails here, not in a test's open-ended step loop.
    idle = getattr(scheduler, "_test_idle_steps", 0)
    scheduler._test_idle_steps = idle + 1 if out.empty and not out.preempted and scheduler.has_unfinished() else 0
    assert scheduler._test_idle_steps < MAX_IDLE_STEPS, f"{MAX_IDLE_STEPS} steps without progress"
    assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    assert out.num_batched_tokens == sum(n for _, n in out.scheduled)
    assert len({r.request_id for r, _ in out.scheduled}) == len(out.scheduled), "scheduled twice"
    for req, n in out.scheduled:
        drafts = out.spec_tokens.get(req.request_id)
        if drafts is not None:
            assert drafts and n == 1 + len(drafts) and req.is_decode
    sampled = []
    for (req, _), s in zip(out.scheduled, out.samples):
        if not s:
            continue
        drafts = out.spec_tokens.get(req.request_id)
        if drafts is None:
            sampled.append(token_fn(req))
        else:
            a = len(drafts) if accept_fn is None else accept_fn(req, drafts)
            sampled.append(list(drafts[:a]) + [token_fn(req)])
    updated = scheduler.update_from_output(out, sampled)
    scheduler.check_invariants()
    return out, updated


def scheduled_ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


def drain(scheduler: Scheduler, token_fn: TokenFn = constant, max_steps: int = 10_000) -> int:
    """Step until every request finished; returns the number of steps."""
    for step in range(max_steps):
        if not scheduler.has_unfinished():
            return step
        out, _ = run_step(scheduler, token_fn)
        assert not out.empty or out.preempted, f"no progress with {scheduler.waiting} waiting"
    raise AssertionError("requests did not finish")


def assert_all_released(scheduler: Scheduler) -> None:
    """After a drain: invariants hold, and once retentions end every block is unreferenced."""
    assert not scheduler.has_unfinished()
    scheduler.check_invariants()
    scheduler.workflows.release_all()
    scheduler.check_invariants()
    assert scheduler.workflows.num_retained_blocks == 0
    assert scheduler.pool.all_unreferenced()
    assert all(b.ref_cnt == 0 for b in scheduler.pool.blocks)


def no_waiting_for_blocks(monkeypatch) -> None:
    """Make a running request short of a block preempt at once, as the scheduler did before it
    learned to shrink chunks and wait while others progress: for tests of preemption itself."""
    monkeypatch.setattr(Scheduler, "MAX_DEFER_STEPS", 0)
    monkeypatch.setattr(Scheduler, "SHRINK_CHUNKS", False)
