"""Property tests: random sequences of adds (shared prefixes, workflow calls), steps with random
tokens, aborts and clock advances keep the scheduler's books straight after every operation, and
once everything drains and retentions end, every block is unreferenced."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sched_utils import EOS, TOKEN, FakeClock, assert_all_released, create_request, create_scheduler, run_step
from sluice.config import SpeculativeConfig
from sluice.engine.errors import RequestRejected
from sluice.engine.request import RequestStatus
from sluice.engine.scheduler import Scheduler

STOP = 9
PREFIXES = [[10_000 * (k + 1) + i for i in range(64)] for k in range(3)]
WORKFLOWS = ["wa", "wb", "wc"]

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([4, 4, 8, 16]),
    "num_blocks": st.integers(4, 24),
    "max_num_batched_tokens": st.integers(2, 64),
    "max_num_seqs": st.integers(1, 6),
    "max_model_len": st.sampled_from([48, 256]),
    "policy": st.sampled_from(["fcfs", "workflow"]),
    "enable_prefix_caching": st.booleans(),
    "retention_ttl_s": st.sampled_from([0.0, 3.0, 10.0]),
    "aging_s": st.sampled_from([0.0, 1.0, 5.0]),
    "speculative": st.sampled_from([None, None, SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)]),
    "close_step_tokens": st.sampled_from([None, 0, 8, 256]),
})

# Each operation is a kind and a seed; the seed picks its details (compact for hypothesis to
# generate and shrink, and every list of them is a valid scenario).
ops = st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort", "advance"]),
                st.integers(0, 2**16))


@dataclass
class Model:
    """What the test knows independently of the scheduler."""

    scheduler: Scheduler
    rnd: random.Random = field(default_factory=lambda: random.Random(0))
    all_requests: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)            # request id -> outputs last seen
    last_tokens: dict = field(default_factory=dict)        # workflow id -> tokens of its last call
    next_id: int = 0


def token_for(rnd: random.Random):
    return lambda req: rnd.choice([TOKEN] * 12 + [EOS, STOP, 11])


def do_add(m: Model, seed: int) -> None:
    """A fresh prompt, or one that starts with a shared prefix, or a workflow's next call that
    extends its previous call's tokens."""
    rnd = random.Random(seed)
    source = rnd.choice(["fresh", "prefix", "continue"])
    k = rnd.randrange(3)
    own = rnd.randint(1, 16)
    max_tokens = rnd.randint(1, 24)
    min_tokens = rnd.choice([0, 0, 0, 1, 3])
    ignore_eos = rnd.random() < 0.2
    wid = WORKFLOWS[k] if rnd.random() < 0.6 else None
    if wid is not None and rnd.random() < 0.3:   # another workflow on this prefix: retentions share blocks
        wid = WORKFLOWS[(k + 1) % 3]
    last = rnd.random() < 0.2
    s = m.scheduler
    own_tokens = [500_000 + m.next_id * 100 + i for i in range(own)]
    if source == "prefix":
        prompt = PREFIXES[k][:rnd.randint(0, 48)] + own_tokens
    elif source == "continue" and wid in m.last_tokens:
        prompt = m.last_tokens[wid] + own_tokens
    else:
        prompt = own_tokens
    capacity = min(s.config.max_model_len, s.pool.num_blocks * s.block_size)
    if rnd.random() < 0.9:                              # mostly requests that can fit
        max_tokens = min(max_tokens, max(1, capacity // 3))
        prompt = prompt[:max(1, capacity - max_tokens)]
    min_tokens = min(min_tokens, max_tokens)
    try:
        s.check_fits(len(prompt), max_tokens)
    except RequestRejected as e:
        assert e.status_code == 400
        assert (len(prompt) + max_tokens > s.config.max_model_len
                or s.kv.blocks_for(len(prompt) + max_tokens) > s.pool.num_blocks)
        return
    req = create_request(s, f"q{m.next_id}", prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                         ignore_eos=ignore_eos, stop_token_ids=[STOP] if m.next_id % 2 else [],
                         workflow_id=wid, is_last_step=last)
    m.next_id += 1
    m.all_requests.append(req)


def do_step(m: Model, seed: int):
    s = m.scheduler
    now = s.clock()
    candidates = list(s.running)
    key = {r.request_id: (s.policy.priority(r, now), -r.num_computed_tokens) for r in candidates}
    protected = {r.request_id for r in candidates if r.protected}
    rnd = random.Random(seed)
    out, updated = run_step(s, token_for(rnd), accept_fn=lambda req, drafts: rnd.randint(0, len(drafts)))
    assert all(n >= 1 for _, n in out.scheduled)
    assert len(updated) <= sum(out.samples)
    for victim in out.preempted:
        # Lowest priority, least progress lost on ties; protected only when all candidates are.
        assert victim in candidates and victim not in [r for r, _ in out.scheduled]
        assert victim.status is RequestStatus.PREEMPTED or victim.is_finished
        pool = [r for r in candidates if r.request_id not in protected] or candidates
        assert victim in pool, f"protected {victim.request_id} preempted before {pool}"
        assert key[victim.request_id] >= max(key[r.request_id] for r in pool)
        candidates.remove(victim)
    if out.preempted:
        assert all(r in candidates for r, _ in out.scheduled), "admitted while preempting"
    for req in updated:
        if req.has_named_workflow and req.is_finished:
            m.last_tokens[req.workflow_id] = list(req.all_token_ids)
    return out


def check_state(m: Model) -> None:
    s = m.scheduler
    s.check_invariants()
    assert len(s.running) <= s.config.max_num_seqs
    ids_running = {r.request_id for r in s.running}
    ids_waiting = {r.request_id for r in s.waiting}
    assert not ids_running & ids_waiting
    assert ids_running | ids_waiting == set(s.requests)
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.blocks == [] and r.num_computed_tokens == 0
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
        assert s.kv.blocks_for(r.num_computed_tokens) <= len(r.blocks) <= s.kv.blocks_for(r.num_tokens)
        assert 0 <= r.num_computed_tokens < r.num_tokens
    stats = s.stats()
    parts = (stats.kv_blocks_used, stats.kv_blocks_retained, stats.kv_blocks_evictable, stats.kv_blocks_free)
    assert min(parts) >= 0 and sum(parts) == s.pool.num_blocks
    # Distinct blocks: a call's, or retentions' only (however many retentions share one).
    by_calls = {b.block_id for r in s.running + s.waiting for b in r.blocks}
    by_retentions = {b.block_id for wf in s.workflows.workflows.values() if wf.retention
                     for b in wf.retention.blocks}
    assert stats.kv_blocks_used == len(by_calls)
    assert stats.kv_blocks_retained == len(by_retentions - by_calls)
    assert (stats.num_running, stats.num_waiting) == (len(s.running), len(s.waiting))
    assert 0 <= s.kv.prefix_hits <= s.kv.prefix_queries
    for r in m.all_requests:
        before = m.outputs.get(r.request_id, [])
        assert r.output_token_ids[:len(before)] == before, "outputs changed"
        m.outputs[r.request_id] = list(r.output_token_ids)
        assert r.num_output_tokens <= r.max_tokens
        if r.num_cached_tokens >= 0:
            # Whole blocks from the prefix cache, plus part of a block only from the retained
            # tail of the call's own workflow.
            assert r.num_cached_tokens < r.num_prompt_tokens
            assert r.num_cached_tokens % s.block_size == 0 or r.has_named_workflow
        if r.is_finished:
            assert r.request_id not in s.requests and r.blocks == []
            check_finish(s, r)


def check_finish(s: Scheduler, r) -> None:
    if r.status is RequestStatus.FINISHED_LENGTH:
        assert r.num_output_tokens == r.max_tokens or r.num_tokens >= s.config.max_model_len
    elif r.status is RequestStatus.FINISHED_STOPPED:
        last = r.output_token_ids[-1]
        assert r.num_output_tokens >= r.params.min_tokens
        assert (last == EOS and not r.params.ignore_eos) or last in r.params.stop_token_ids
    else:
        assert r.status is RequestStatus.FINISHED_ABORTED


def drain(m: Model) -> None:
    s = m.scheduler
    stalls = 0
    for step in range(5000):
        if not s.has_unfinished():
            return
        out = do_step(m, m.rnd.randrange(2**16))
        check_state(m)
        if out.empty and not out.preempted:
            # Waiting work may be held back by retentions worth more than it: they expire.
            stalls += 1
            assert stalls <= 2, f"stalled: {s.waiting} waiting, {s.running} running"
            s.clock.advance(s.config.retention_ttl_s + 1)
        else:
            stalls = 0
    raise AssertionError("did not drain")


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, operations=st.lists(ops, min_size=15, max_size=60))
def test_random_operations_keep_the_books(config, operations):
    s = create_scheduler(**config)
    assert isinstance(s.clock, FakeClock)
    m = Model(s)
    for kind, arg in operations:
        if kind == "add":
            do_add(m, arg)
        elif kind == "step":
            do_step(m, arg)
        elif kind == "abort":
            if m.all_requests:
                req = m.all_requests[arg % len(m.all_requests)]
                was_finished = req.is_finished
                got = s.abort_request(req.request_id)
                assert (got is None) == was_finished
                assert req.is_finished
        else:
            s.clock.advance([0.1, 1.0, 4.0, 11.0][arg % 4])
        check_state(m)
    drain(m)
    for r in m.all_requests:
        assert r.is_finished
    assert_all_released(s)
