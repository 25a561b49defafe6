"""Workflow-aware scheduling: least attained service with aging and cache affinity, KV retention
between a workflow's calls (TTL, last step, early release by the cost rule), admission bounds and
the choice of preemption victims."""
from __future__ import annotations

import dataclasses
import math

import pytest

from sched_utils import (
    no_waiting_for_blocks,
    assert_all_released,
    create_request,
    create_scheduler,
    drain,
    run_step,
    scheduled_ids,
    TOKEN,
    unique_prompt,
)
from sluice.engine.admission import WorkflowLimit
from sluice.engine.errors import RequestRejected
from sluice.engine.request import RequestStatus


def by_output_index(req) -> int:
    return 100 + req.num_output_tokens


def give_service(s, workflow_id: str, num_tokens: int) -> None:
    """Run one call of the workflow to completion, so it has attained `num_tokens` of service."""
    create_request(s, f"{workflow_id}-warmup", num_tokens, max_tokens=1, workflow_id=workflow_id)
    drain(s)
    assert s.workflows.workflows[workflow_id].service == num_tokens


def first_admitted(s) -> str:
    out, _ = run_step(s)
    return out.scheduled[0][0].request_id


# --- ordering -----------------------------------------------------------------------------------
def heavy_and_light(policy: str, schedule_at: float, aging_s: float = 5.0):
    """`heavy` (a call of a workflow with 600 tokens of service) arrives at t=0, `light` (a new
    workflow's first call) at t=1; one of them can run."""
    s = create_scheduler(policy=policy, max_num_seqs=1, retention_ttl_s=0, aging_s=aging_s)
    give_service(s, "heavy-wf", 600)
    s.clock.t = 0.0
    create_request(s, "heavy", 10, workflow_id="heavy-wf", max_tokens=2)
    s.clock.t = 1.0
    create_request(s, "light", 10, workflow_id="light-wf", max_tokens=2)
    s.clock.t = schedule_at
    return s


def test_workflow_policy_serves_least_attained_service_first():
    s = heavy_and_light("workflow", schedule_at=1.0)
    assert s.policy.level(s.requests["heavy"], 1.0) == 1
    assert s.policy.level(s.requests["light"], 1.0) == 0
    assert first_admitted(s) == "light"
    drain(s)
    assert_all_released(s)


def test_fcfs_orders_by_arrival():
    s = heavy_and_light("fcfs", schedule_at=1.0)
    assert first_admitted(s) == "heavy"
    drain(s)
    assert_all_released(s)


def test_aging_promotes_a_starved_call():
    s = heavy_and_light("workflow", schedule_at=4.99)
    assert first_admitted(s) == "light"
    s = heavy_and_light("workflow", schedule_at=5.0)     # heavy waited aging_s: one level up
    assert s.policy.level(s.requests["heavy"], 5.0) == 0
    assert first_admitted(s) == "heavy"
    drain(s)
    assert_all_released(s)


def test_without_aging_a_heavy_workflow_keeps_waiting():
    s = heavy_and_light("workflow", schedule_at=1000.0, aging_s=0)
    assert first_admitted(s) == "light"


def test_resident_prefix_goes_first_within_a_level():
    """Both workflows are at level 0; the one with retained KV goes before an earlier arrival."""
    for policy, expected in (("workflow", "resident"), ("fcfs", "cold")):
        s = create_scheduler(policy=policy, max_num_seqs=1)
        prompt = unique_prompt(40)
        create_request(s, "prev", prompt, max_tokens=1, workflow_id="res-wf")
        drain(s)
        assert s.workflows.num_retained_blocks == 3     # 40 tokens: two full blocks and the tail
        s.clock.advance(1)
        create_request(s, "cold", 40, max_tokens=1, workflow_id="cold-wf")
        s.clock.advance(1)
        create_request(s, "resident", prompt + [5, 6], max_tokens=1, workflow_id="res-wf")
        assert first_admitted(s) == expected, policy
        drain(s)
        assert_all_released(s)


def test_held_prefix_goes_first_within_a_level():
    """A call whose workflow has a running call holding KV goes before an earlier cold call."""
    s = create_scheduler(policy="workflow", max_num_seqs=2)
    prompt = unique_prompt(40)
    create_request(s, "sibling", prompt + [1], max_tokens=20, workflow_id="fan-wf")
    run_step(s)
    s.clock.advance(1)
    create_request(s, "cold", 40, max_tokens=1, workflow_id="cold-wf")
    s.clock.advance(1)
    warm = create_request(s, "warm", prompt + [2], max_tokens=1, workflow_id="fan-wf")
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("warm", 9)]   # the sibling's decode yields the step to prompts
    assert warm.num_cached_tokens == 32
    drain(s)
    assert_all_released(s)


def test_shortest_remaining_prompt_goes_first_within_a_level():
    """Two new workflows (level 0, nothing resident): the workflow policy takes the call with
    fewer tokens to compute first, whatever their arrival order; fcfs takes the earlier one."""
    for policy, expected in (("workflow", "short"), ("fcfs", "long")):
        s = create_scheduler(policy=policy, max_num_seqs=1)
        create_request(s, "long", 300, max_tokens=1, workflow_id="long-wf")
        s.clock.advance(1)
        create_request(s, "short", 50, max_tokens=1, workflow_id="short-wf")
        assert first_admitted(s) == expected, policy
        drain(s)
        assert_all_released(s)


def test_remaining_prompt_counts_what_the_workflow_retains():
    """A resident call's remaining work is what lies beyond its workflow's retained KV: a long
    follow-up with a short new turn goes before a shorter call with more new tokens, among
    resident calls of one level."""
    s = create_scheduler(policy="workflow", max_num_seqs=2)
    prompts = {w: unique_prompt(200) for w in ("a", "b")}
    for w in ("a", "b"):
        create_request(s, f"{w}0", prompts[w], max_tokens=1, workflow_id=w)
    drain(s)
    s.clock.advance(1)
    create_request(s, "b1", prompts["b"] + unique_prompt(100), max_tokens=1, workflow_id="b")   # 100 new
    s.clock.advance(1)
    a1 = create_request(s, "a1", prompts["a"] + unique_prompt(20) + unique_prompt(100)[:10], max_tokens=1,
                        workflow_id="a")   # 30 new, 230 in all
    wf = s.workflows.workflows
    assert s.policy.remaining(a1, wf["a"]) == 30 and s.policy.remaining(s.requests["b1"], wf["b"]) == 100
    out, _ = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["a1", "b1"]
    drain(s)
    assert_all_released(s)


def three_prompts(close_step_tokens, sizes=(300, 300, 300), budget=1024):
    s = create_scheduler(policy="fcfs", max_num_batched_tokens=budget, close_step_tokens=close_step_tokens)
    for i, n in enumerate(sizes):
        create_request(s, f"p{i}", n, max_tokens=2, ignore_eos=True)
        s.clock.advance(1)
    return s


def test_a_completed_prompt_closes_the_step_to_more_prompt_work():
    """With close_step_tokens 256, the step that completes p0's 300-token prompt takes no more
    prompt work (its first token would wait for it); the next prompts follow one a step (the
    first decode sits that step out: decode_yield_steps). Without it, the budget takes all three."""
    s = three_prompts(256)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p0", 300)] and out.samples == [True]
    assert [r.request_id for r in s.waiting] == ["p1", "p2"]
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p1", 300)]
    drain(s)
    assert_all_released(s)
    s = three_prompts(None)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p0", 300), ("p1", 300), ("p2", 300)]
    drain(s)
    assert_all_released(s)


def test_a_prompt_completed_below_the_threshold_leaves_the_step_open():
    """p0's 100 tokens finish at 100 < 256: the step goes on to p1 (400 tokens), which closes it."""
    s = three_prompts(256, sizes=(100, 300, 300))
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p0", 100), ("p1", 300)]
    drain(s)
    assert_all_released(s)
    s = three_prompts(0, sizes=(100, 300, 300))   # 0: every completed prompt closes its step
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p0", 100)]
    drain(s)
    assert_all_released(s)


def test_the_last_chunk_of_a_running_prompt_closes_the_step():
    """p0 (800 tokens) runs in chunks of the 512-token budget; its last 288 complete it and close
    the step, so p1 (arrived meanwhile) starts in the next step, with the budget left unspent."""
    s = three_prompts(256, sizes=(800,), budget=512)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p0", 512)]
    create_request(s, "p1", 200, max_tokens=2, ignore_eos=True)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p0", 288)] and out.num_batched_tokens == 288
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("p1", 200)]
    drain(s)
    assert_all_released(s)


def test_close_step_tokens_is_a_server_flag_128_by_default_and_validated():
    import argparse

    from sluice.cli import add_engine_args, build_engine_config
    from sluice.config import SchedulerConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config(parser.parse_args([])).scheduler.close_step_tokens == 128
    assert SchedulerConfig().close_step_tokens == 128
    assert build_engine_config(parser.parse_args(["--close-step-tokens", "0"])).scheduler.close_step_tokens == 0
    assert build_engine_config(parser.parse_args(["--close-step-tokens", "none"])).scheduler.close_step_tokens is None
    for bad in ("-1", "many", "2.5"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--close-step-tokens", bad])
    with pytest.raises(ValueError, match="close_step_tokens"):
        SchedulerConfig(close_step_tokens=-1)


# --- KV retention -------------------------------------------------------------------------------
def first_call(s, workflow_id="agent", is_last_step=False):
    """44 prompt + 5 output tokens: 48 computed at the end, three full blocks of 16."""
    call = create_request(s, "call1", 44, max_tokens=5, workflow_id=workflow_id, is_last_step=is_last_step)
    drain(s)
    assert call.status is RequestStatus.FINISHED_LENGTH and call.num_computed_tokens == 48
    return call


def test_finished_call_retains_its_full_cached_blocks():
    s = create_scheduler(block_size=16, num_blocks=20)
    call1 = first_call(s)
    wf = s.workflows.workflows["agent"]
    assert wf.retention is not None and s.workflows.num_retained_blocks == 3
    assert all(b.ref_cnt == 1 and b.hash_key is not None for b in wf.retention.blocks)
    assert wf.retention.num_tokens == 48
    stats = s.stats()
    assert stats.kv_blocks_retained == 3 and stats.kv_blocks_used == 0
    assert stats.kv_blocks_free + stats.kv_blocks_evictable == 17
    s.check_invariants()

    # The next call extends the conversation: its prefix is a hit, and it takes the blocks over.
    call2 = create_request(s, "call2", call1.all_token_ids + unique_prompt(10), max_tokens=6,
                           workflow_id="agent")
    retained = list(wf.retention.blocks)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("call2", 59 - 48)]
    assert call2.num_cached_tokens == 48 and call2.blocks[:3] == retained
    assert wf.retention is None and s.workflows.num_retained_blocks == 0
    assert all(b.ref_cnt == 1 for b in retained)
    drain(s)
    assert s.workflows.num_retained_blocks == 4         # 59 + 6 tokens: 64 computed
    assert_all_released(s)


def test_retained_blocks_two_workflows_share_count_once():
    """/metrics' retained blocks are distinct blocks only retentions hold: two workflows on one
    system prompt retain its blocks together, and a running call that reads them makes them used."""
    s = create_scheduler(block_size=16, num_blocks=20)
    system = unique_prompt(32)                       # two full blocks every call shares
    for wid in ("a", "b"):
        call = create_request(s, wid, system + unique_prompt(13), max_tokens=4, workflow_id=wid)
        drain(s)
        assert call.num_computed_tokens == 48         # three full blocks retained
    assert s.workflows.num_retained_blocks == 6       # references: the shared two held twice
    stats = s.stats()
    assert (stats.kv_blocks_retained, stats.kv_blocks_used) == (4, 0)
    assert stats.kv_blocks_retained + stats.kv_blocks_evictable + stats.kv_blocks_free == 20

    reader = create_request(s, "reader", system + unique_prompt(5), max_tokens=8)
    run_step(s)
    assert reader.num_cached_tokens == 32 and len(reader.blocks) == 3
    stats = s.stats()
    assert stats.kv_blocks_used == 3                  # the shared two and its own
    assert stats.kv_blocks_retained == 2              # each workflow's third block
    assert (stats.kv_blocks_used + stats.kv_blocks_retained + stats.kv_blocks_evictable
            + stats.kv_blocks_free) == 20
    s.check_invariants()
    drain(s)
    assert s.stats().kv_blocks_retained == 4
    assert_all_released(s)


def tail_call(s):
    """40 prompt + 6 output tokens: 45 computed, two full blocks and 13 tokens in a third."""
    call = create_request(s, "call1", 40, max_tokens=6, workflow_id="agent")
    drain(s)
    assert call.num_computed_tokens == 45
    return call


def test_finished_call_retains_its_partly_filled_last_block():
    s = create_scheduler(block_size=16, num_blocks=20)
    call1 = tail_call(s)
    r = s.workflows.workflows["agent"].retention
    assert len(r.blocks) == 3 and r.num_full_blocks == 2 and r.num_tokens == 45
    assert r.tail_tokens == tuple(call1.all_token_ids[32:45])
    tail = r.blocks[2]
    assert tail.ref_cnt == 1 and tail.hash_key is None
    assert s.stats().kv_blocks_retained == 3
    s.check_invariants()

    # The next call continues all 45 tokens: it takes the tail over and computes from token 45.
    call2 = create_request(s, "call2", call1.all_token_ids + unique_prompt(10), max_tokens=2,
                           workflow_id="agent", is_last_step=True)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("call2", 56 - 45)]
    assert call2.num_cached_tokens == 45 and call2.blocks[2] is tail and tail.ref_cnt == 1
    assert s.workflows.workflows["agent"].retention is None
    drain(s)
    assert_all_released(s)


def test_cache_salt_shares_kv_only_within_its_salt():
    """vLLM's cache_salt: the prefix cache and a workflow's retained KV (its tail block too) serve
    a call only when its salt is the one they were computed under; no salt is a salt of its own."""
    s = create_scheduler(block_size=16, num_blocks=40)
    prompt = unique_prompt(40)
    cached = {}
    for i, salt in enumerate(["a", "a", "b", None, None, "b"]):
        call = create_request(s, f"c{i}", prompt, max_tokens=1, cache_salt=salt)
        drain(s)
        cached[i] = call.num_cached_tokens
    assert cached == {0: 0, 1: 32, 2: 0, 3: 0, 4: 32, 5: 32}
    assert_all_released(s)

    for salt, expected in (("other", 0), ("tenant", 45)):
        call1 = create_request(s, f"w-{salt}-1", 40, max_tokens=6, workflow_id=f"w-{salt}", cache_salt="tenant")
        drain(s)
        assert call1.num_computed_tokens == 45 and s.workflows.workflows[f"w-{salt}"].retention.tail_tokens
        call2 = create_request(s, f"w-{salt}-2", call1.all_token_ids + unique_prompt(10), max_tokens=2,
                               workflow_id=f"w-{salt}", is_last_step=True, cache_salt=salt)
        run_step(s)
        assert call2.num_cached_tokens == expected, salt
        drain(s)
    assert_all_released(s)


def test_a_call_continuing_part_of_the_tail_takes_it_and_overwrites_the_rest():
    s = create_scheduler(block_size=16, num_blocks=20)
    call1 = tail_call(s)
    tail = s.workflows.workflows["agent"].retention.blocks[2]
    call2 = create_request(s, "call2", call1.all_token_ids[:37] + unique_prompt(20), max_tokens=2,
                           workflow_id="agent")
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("call2", 57 - 37)]
    assert call2.num_cached_tokens == 37 and call2.blocks[2] is tail
    drain(s)
    assert_all_released(s)


def test_a_call_that_diverges_before_the_tail_does_not_take_it():
    s = create_scheduler(block_size=16, num_blocks=20)
    call1 = tail_call(s)
    tail = s.workflows.workflows["agent"].retention.blocks[2]
    for prompt, hit in ((call1.all_token_ids[:32] + unique_prompt(8), 32),     # at the tail's start
                        (call1.all_token_ids[:20] + unique_prompt(8), 16)):    # inside a full block
        call = create_request(s, f"branch-{hit}", prompt, max_tokens=1, workflow_id="agent")
        out, _ = run_step(s)
        assert call.num_cached_tokens == hit and tail not in call.blocks
        assert tail.ref_cnt == 0, "the retention's end frees the tail block"
        drain(s)
        s.check_invariants()
        tail = s.workflows.workflows["agent"].retention.blocks[-1]
    assert_all_released(s)


def test_the_tail_is_not_taken_by_another_workflow_with_the_same_tokens():
    s = create_scheduler(block_size=16, num_blocks=20)
    call1 = tail_call(s)
    tail = s.workflows.workflows["agent"].retention.blocks[2]
    other = create_request(s, "other", call1.all_token_ids + unique_prompt(4), max_tokens=1, workflow_id="other")
    run_step(s)
    assert other.num_cached_tokens == 32 and tail not in other.blocks
    assert s.workflows.workflows["agent"].retention.blocks[2] is tail and tail.ref_cnt == 1
    drain(s)
    assert_all_released(s)


def test_a_tail_is_given_up_when_the_next_call_needs_the_memory():
    """The next call does not fit beside the retentions: ending its own frees the tail (it was
    private), so the call recomputes those tokens, and another workflow's retention makes room."""
    s = create_scheduler(block_size=16, num_blocks=8, retention_ttl_s=10)
    call1 = tail_call(s)
    create_request(s, "o1", 40, max_tokens=6, workflow_id="other")
    drain(s)
    assert s.workflows.num_retained_blocks == 6 and s.pool.num_free_blocks == 2
    # 46 + 40 prompt tokens, 1 to generate: six blocks, three beyond the retained ones.
    call2 = create_request(s, "call2", call1.all_token_ids + unique_prompt(40), max_tokens=1,
                           workflow_id="agent")
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("call2", 86 - 32)] and call2.num_cached_tokens == 32
    assert s.workflows.workflows["other"].retention is None
    drain(s)
    assert call2.num_output_tokens == 1
    assert_all_released(s)


def test_retention_protects_blocks_from_eviction():
    s = create_scheduler(block_size=16, num_blocks=10)
    call1 = first_call(s)
    create_request(s, "big", 112, max_tokens=1)          # takes every unretained block
    drain(s)
    assert s.workflows.num_retained_blocks == 3
    call2 = create_request(s, "call2", call1.all_token_ids + [1], max_tokens=1, workflow_id="agent")
    run_step(s)
    assert call2.num_cached_tokens == 48
    assert_all_released(s)


def test_retention_expires_after_ttl():
    s = create_scheduler(block_size=16, retention_ttl_s=10)
    call1 = first_call(s)
    s.clock.advance(9.9)
    s.schedule()
    assert s.workflows.num_retained_blocks == 3
    s.clock.advance(0.1)
    s.schedule()
    assert s.workflows.num_retained_blocks == 0 and s.stats().kv_blocks_retained == 0
    assert s.pool.all_unreferenced() and s.pool.num_evictable_blocks == 3
    # Released, not evicted: still a prefix hit while nothing reuses the blocks.
    call2 = create_request(s, "call2", call1.all_token_ids + [1], max_tokens=1, workflow_id="agent")
    run_step(s)
    assert call2.num_cached_tokens == 48
    assert_all_released(s)


def test_last_step_releases_immediately():
    s = create_scheduler(block_size=16)
    first_call(s, is_last_step=True)
    assert s.workflows.num_retained_blocks == 0 and s.pool.all_unreferenced()
    assert_all_released(s)


def test_last_step_releases_the_workflows_retention():
    """A parallel call retains KV while the workflow's last step runs; the last step's end
    releases it."""
    s = create_scheduler(block_size=16)
    last = create_request(s, "last", 20, max_tokens=8, workflow_id="agent", is_last_step=True)
    branch = create_request(s, "branch", 44, max_tokens=2, workflow_id="agent")
    while not branch.is_finished:
        run_step(s)
    assert not last.is_finished and s.workflows.num_retained_blocks == 3   # 45 computed: 2 full + tail
    drain(s)
    assert last.status is RequestStatus.FINISHED_LENGTH
    assert s.workflows.num_retained_blocks == 0 and s.pool.all_unreferenced()
    assert_all_released(s)


def test_unnamed_and_aborted_calls_retain_nothing():
    s = create_scheduler(block_size=16)
    create_request(s, "anon", 44, max_tokens=5)
    drain(s)
    assert s.workflows.num_retained_blocks == 0
    call = create_request(s, "aborted", 44, max_tokens=5, workflow_id="agent")
    run_step(s)
    run_step(s)
    s.abort_request("aborted")
    assert call.status is RequestStatus.FINISHED_ABORTED and s.workflows.num_retained_blocks == 0
    assert s.pool.all_unreferenced()
    assert_all_released(s)


def test_zero_ttl_retains_nothing():
    s = create_scheduler(block_size=16, retention_ttl_s=0)
    first_call(s)
    assert s.workflows.num_retained_blocks == 0 and s.pool.all_unreferenced()


# --- early release by the cost rule ------------------------------------------------------------
def two_retentions(num_blocks: int):
    """Workflow `old` retains 3 blocks (48 tokens) from t=0, `new` 3 blocks from t=2; the clock
    reads 2. With no observed gap, a retention's value decays on a scale of TTL/2 = 5 s."""
    s = create_scheduler(block_size=16, num_blocks=num_blocks, retention_ttl_s=10)
    create_request(s, "old-call", 48, max_tokens=1, workflow_id="old")
    drain(s)
    s.clock.advance(2)
    create_request(s, "new-call", 48, max_tokens=1, workflow_id="new")
    drain(s)
    assert s.workflows.num_retained_blocks == 6
    tracker = s.workflows
    assert tracker.retention_value(tracker.workflows["old"], 2.0) == pytest.approx(48 * math.exp(-0.4))
    assert tracker.retention_value(tracker.workflows["new"], 2.0) == pytest.approx(48)
    return s


def test_memory_pressure_releases_the_least_valuable_retention():
    s = two_retentions(num_blocks=10)
    x = create_request(s, "x", 100, max_tokens=1)       # 7 blocks; 4 are free
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("x", 100)] and x.is_finished
    assert s.workflows.workflows["old"].retention is None
    assert s.workflows.workflows["new"].retention is not None
    assert s.workflows.num_retained_blocks == 3
    assert_all_released(s)


def test_retention_is_not_released_for_a_request_worth_less():
    s = two_retentions(num_blocks=8)                     # two blocks free
    busy = create_request(s, "busy", 8, max_tokens=6, ignore_eos=True)  # keeps the engine busy in one block
    x = create_request(s, "x", 20, max_tokens=1)         # needs 2 blocks; worth 20 tokens
    out = s.schedule()
    assert scheduled_ids(out) == [("busy", 8)] and x.status is RequestStatus.WAITING
    s.update_from_output(out, [7])
    assert s.workflows.num_retained_blocks == 6
    # busy's decode would yield this step to x, but x does not get in: the step is busy's
    # decode (not an idle engine, so the retentions are not given up for x either)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("busy", 1)] and x.status is RequestStatus.WAITING
    assert s.workflows.num_retained_blocks == 6
    s.clock.t = 4.5                                      # old's value: 48 e^-0.9 = 19.5 < 20
    out, _ = run_step(s)
    assert ("x", 20) in scheduled_ids(out)
    assert s.workflows.workflows["old"].retention is None
    assert s.workflows.workflows["new"].retention is not None   # 48 e^-0.5 = 29.1: kept
    drain(s)
    assert_all_released(s)


def test_an_idle_engine_releases_retention_for_waiting_work():
    """With nothing else to run, waiting work gets the memory whatever the retention is worth
    (holding it would leave the engine idle until the TTL ends)."""
    s = two_retentions(num_blocks=7)                     # one block free
    x = create_request(s, "x", 20, max_tokens=1)         # needs 2 blocks; worth less than either
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("x", 20)]
    assert s.workflows.workflows["old"].retention is None  # the least valuable one went
    drain(s)
    assert_all_released(s)


def test_next_call_is_not_blocked_by_its_own_retention():
    """The call that would take the retention over needs memory the retention holds (its prompt
    does not extend the retained one): it is admitted now, not after the TTL."""
    s = create_scheduler(block_size=16, num_blocks=8, retention_ttl_s=10)
    create_request(s, "call1", 96, max_tokens=1, workflow_id="agent")
    drain(s)
    assert s.workflows.num_retained_blocks == 6 and s.pool.num_free_blocks == 2
    call2 = create_request(s, "call2", 60, max_tokens=4, workflow_id="agent")
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("call2", 60)]
    drain(s)
    assert call2.num_output_tokens == 4
    assert_all_released(s)


def test_own_retention_hits_survive_when_memory_is_short():
    """Ending its own retention to make room keeps the shared blocks cached: the call (which
    branches off after 48 of the 96 retained tokens) still hits them, and other workflows keep
    their retentions."""
    s = create_scheduler(block_size=16, num_blocks=13, retention_ttl_s=10)
    call1 = create_request(s, "call1", 96, max_tokens=1, workflow_id="agent")
    create_request(s, "other", 48, max_tokens=1, workflow_id="other")
    drain(s)
    assert s.workflows.num_retained_blocks == 9 and s.pool.num_free_blocks == 4
    call2 = create_request(s, "call2", call1.prompt_token_ids[:48] + unique_prompt(72), max_tokens=1,
                           workflow_id="agent")
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("call2", 72)] and call2.num_cached_tokens == 48
    assert s.workflows.workflows["other"].retention is not None
    assert_all_released(s)


def test_running_request_takes_retained_blocks_before_preempting():
    s = create_scheduler(block_size=16, num_blocks=5)
    create_request(s, "prev", 48, max_tokens=1, workflow_id="agent")
    drain(s)
    assert s.workflows.num_retained_blocks == 3
    r = create_request(s, "r", 31, max_tokens=4)         # 2 blocks, a third at token 33
    drain(s)
    assert r.num_output_tokens == 4 and r.num_preemptions == 0 and s.num_preemptions == 0
    assert s.workflows.num_retained_blocks == 0
    assert_all_released(s)


# --- admission bounds ---------------------------------------------------------------------------
def test_admission_bound_on_waiting_requests():
    s = create_scheduler(max_waiting_requests=2)
    accepted = []
    for i in range(2):
        s.check_admission(1, 10)
        accepted.append(create_request(s, f"r{i}", 10, max_tokens=2))
    assert not s.accepting() and not s.stats().accepting
    with pytest.raises(RequestRejected) as e:
        s.check_admission(1, 10)
    assert e.value.status_code == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.retry_after is not None and e.value.retry_after > 0
    with pytest.raises(RequestRejected):
        s.check_admission(3, 0)                          # n > 1 counts every sample
    run_step(s)                                          # both admitted: the queue is empty again
    s.check_admission(2, 10)
    drain(s)
    assert all(r.num_output_tokens == 2 for r in accepted)
    assert_all_released(s)


def test_admission_bound_on_waiting_tokens():
    s = create_scheduler(max_waiting_tokens=100)
    s.check_admission(1, 40)
    a = create_request(s, "a", 40, max_tokens=2)
    s.check_admission(1, 40)
    b = create_request(s, "b", 40, max_tokens=2)
    assert s.num_waiting_tokens == 80
    with pytest.raises(RequestRejected) as e:
        s.check_admission(1, 40)
    assert e.value.status_code == 429 and e.value.retry_after > 0
    s.check_admission(1, 20)                             # exactly at the bound is fine
    drain(s)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 2
    s.check_admission(1, 100)
    assert_all_released(s)


# --- preemption victims -------------------------------------------------------------------------
def three_decodes(stagger: float):
    """A (7-token prompt), B (1) and C (9) fill a 6-block pool of 4-token blocks; at the third
    step A needs a third block and someone must yield."""
    s = create_scheduler(block_size=4, num_blocks=6)
    reqs = []
    for name, n in (("A", 7), ("B", 1), ("C", 9)):
        reqs.append(create_request(s, name, n, max_tokens=6, ignore_eos=True))
        s.clock.advance(stagger)
    for _ in range(2):
        out, _ = run_step(s, by_output_index)
        assert not out.preempted
    return s, reqs


def test_victim_is_the_lowest_priority_request(monkeypatch):
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    s, (a, b, c) = three_decodes(stagger=1.0)
    out, _ = run_step(s, by_output_index)
    assert out.preempted == [c]                          # the latest arrival, despite its progress
    drain(s, by_output_index)
    assert all(r.output_token_ids == [100 + i for i in range(6)] for r in (a, b, c))
    assert_all_released(s)


def test_victim_ties_go_to_least_progress_lost(monkeypatch):
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    s, (a, b, c) = three_decodes(stagger=0.0)            # equal priorities
    out, _ = run_step(s, by_output_index)
    assert out.preempted == [b]                          # 2 computed tokens, against 8 and 10
    drain(s, by_output_index)
    assert all(r.output_token_ids == [100 + i for i in range(6)] for r in (a, b, c))
    assert_all_released(s)


def test_victim_may_be_the_request_that_needs_the_block(monkeypatch):
    """A low-priority decode that needs a block yields itself rather than evict a more important
    request that is still prefilling (and needs no block this step)."""
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    s = create_scheduler(block_size=4, num_blocks=4, max_num_batched_tokens=2, decode_yield_steps=0)
    s.clock.advance(1)
    low = create_request(s, "low", 2, max_tokens=10, ignore_eos=True)
    run_step(s, by_output_index)
    high = create_request(s, "high", 8, max_tokens=1, ignore_eos=True, arrival_time=0.0)
    # Each step: one token for low's decode, one for high's prefill. At low's ninth token the
    # four blocks are taken (low 2, high 2) and low needs a third while high still has room.
    preempted = []
    while s.has_unfinished():
        out, _ = run_step(s, by_output_index)
        preempted += out.preempted
    assert preempted and high not in preempted and high.num_preemptions == 0
    assert low.output_token_ids == [100 + i for i in range(10)]
    assert_all_released(s)


def test_resumed_request_is_not_preempted_again_before_progress(monkeypatch):
    """`late` yields to `early`, resumes (protected) and needs a block again before sampling:
    this time `early` yields, although it has the better priority and was already scheduled."""
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    s = create_scheduler(block_size=4, num_blocks=4, max_num_batched_tokens=4, decode_yield_steps=0)
    early = create_request(s, "early", 7, max_tokens=7, ignore_eos=True)
    s.clock.advance(1)
    run_step(s, by_output_index)
    s.clock.advance(1)
    run_step(s, by_output_index)
    late = create_request(s, "late", 7, max_tokens=3, ignore_eos=True)
    events = []
    while s.has_unfinished():
        s.clock.advance(1)
        protected = {r.request_id for r in s.running if r.protected}
        running = {r.request_id for r in s.running}
        out, _ = run_step(s, by_output_index)
        for victim in out.preempted:
            events.append((victim.request_id, sorted(protected)))
            if victim.request_id in protected:
                assert running <= protected, "a protected request was preempted before the others"
            if victim is early:
                assert early not in [r for r, _ in out.scheduled]   # withdrawn from the batch
    assert events == [("late", []), ("early", ["late"])]
    assert early.output_token_ids == [100 + i for i in range(7)]
    assert late.output_token_ids == [100 + i for i in range(3)]
    assert_all_released(s)


# --- memory pressure ----------------------------------------------------------------------------
def pressured(schedule_at: float, heavy_at: float = 0.0, starvation_s=None):
    """A 10-block pool, 8 of them retained by `heavy-wf` (600+ tokens of service): under pressure.
    `light` (a new workflow's call) arrives at t=1, `heavy` (heavy-wf's follow-up call, resident)
    at `heavy_at`."""
    s = create_scheduler(policy="workflow", num_blocks=10, max_num_seqs=1, retention_ttl_s=1000,
                         starvation_s=starvation_s)
    prompt = unique_prompt(128)
    create_request(s, "heavy-warmup", prompt, max_tokens=1, workflow_id="heavy-wf")
    drain(s)
    s.workflows.workflows["heavy-wf"].service = 600
    assert s.workflows.num_retained_blocks == 8 and s.policy.under_pressure()
    s.clock.t = 1.0
    create_request(s, "light", 10, max_tokens=2, workflow_id="light-wf")
    s.clock.t = heavy_at
    create_request(s, "heavy", prompt + [5, 6], max_tokens=2, workflow_id="heavy-wf")
    s.clock.t = schedule_at
    return s


def test_under_pressure_resident_work_goes_before_new_workflows():
    """Least attained service would pick `light` (level 0 against 1) and evict `heavy`'s KV;
    under memory pressure the resident follow-up call goes first."""
    s = pressured(schedule_at=1.0)
    assert s.policy.level(s.requests["light"], 1.0) < s.policy.level(s.requests["heavy"], 1.0)
    assert first_admitted(s) == "heavy"
    drain(s)
    assert_all_released(s)


def test_under_pressure_a_starving_call_goes_first():
    starve = 1.0 + s_starve() + 0.01
    s = pressured(schedule_at=starve, heavy_at=starve - 1.0)
    assert first_admitted(s) == "light"
    drain(s)
    assert_all_released(s)


def test_the_starvation_bound_is_configurable():
    s = pressured(schedule_at=1.0 + 3.0 + 0.01, heavy_at=3.0, starvation_s=3.0)
    assert first_admitted(s) == "light"        # waited 3.01 s > 3 s
    s = pressured(schedule_at=1.0 + 2.9, heavy_at=2.0, starvation_s=3.0)
    assert first_admitted(s) == "heavy"


def s_starve() -> float:
    from sluice.engine.policies import WorkflowPolicy

    return WorkflowPolicy.STARVATION_AGING * 5.0


def test_under_pressure_the_victim_is_the_resident_call_with_least_service():
    s = create_scheduler(policy="workflow", num_blocks=10, max_num_batched_tokens=64)
    create_request(s, "big", 64, max_tokens=40, ignore_eos=True, workflow_id="big-wf")
    create_request(s, "small", 64, max_tokens=40, ignore_eos=True, workflow_id="small-wf")
    run_step(s)
    run_step(s)
    s.workflows.workflows["big-wf"].service = 5000
    assert s.policy.under_pressure()
    preempted = []
    while s.has_unfinished():
        out, _ = run_step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "small"
    assert_all_released(s)


# --- workflow-level admission (GET /load "accepting") ---------------------------------------------
def test_new_workflows_are_welcome_only_with_room_for_a_typical_call():
    """40 blocks of 16 tokens. A typical call starts at min(1k tokens, an eighth of the cache) = 5
    blocks and follows finished calls (moving average); `accepting` needs that many blocks beyond
    what calls, running or waiting, will grow into up to their max_tokens. These calls are each
    their workflow's last, so no further calls are reserved for (see the next test)."""
    s = create_scheduler(num_blocks=40, retention_ttl_s=100.0)
    assert s.typical_call_blocks == 5 and s.kv_headroom() == 40 and s.accepting()
    # Two calls that will each grow to 16 blocks (100 + 156 tokens).
    a = create_request(s, "a", 100, max_tokens=156, workflow_id="wf-a", is_last_step=True)
    b = create_request(s, "b", 100, max_tokens=156, workflow_id="wf-b", is_last_step=True)
    assert s.kv_headroom() == 40 - 2 * 16               # waiting: up to max_tokens already
    run_step(s)
    assert len(a.blocks) == 7 and len(b.blocks) == 7
    assert s.kv_headroom() == 40 - 2 * 16               # running: the same, held or to come
    assert s.accepting() and s.admissible_workflows() == 1   # 8 >= 5, and not two of 5 + growth
    create_request(s, "c", 100, max_tokens=20, workflow_id="wf-c", is_last_step=True)  # 8 blocks at most
    assert s.kv_headroom() == 0 and not s.accepting() and not s.stats().accepting
    assert s.admissible_workflows() == 0 and s.stats().admissible_workflows == 0
    drain(s)
    assert s.workflows.num_retained_blocks == 0 and s.kv_headroom() == 40 and s.accepting()
    # The average moved towards the finished calls' sizes (16, 16 and 8 blocks).
    assert s.typical_call_blocks > 5
    assert_all_released(s)


def test_admissible_workflows_counts_what_each_new_workflow_will_reserve():
    """`admissible_workflows` is how many new workflows fit the headroom one after another: the
    first needs a typical call's blocks, each one after it what a workflow reserves once in (its
    call to max_tokens plus its growth, at least a typical final size). Admitting that many
    typical first calls leaves the server not accepting, and one fewer leaves it accepting. (The
    prefill-backlog bounds are off here: they have tests of their own.)"""
    s = create_scheduler(num_blocks=400, retention_ttl_s=100.0, admit_backlog_steps=None)
    call, g, final = s.typical_call_blocks, s.typical_growth_blocks, s.typical_final_blocks
    assert (call, g, final) == (50, 25, 50)
    per = max(call + g, final)                          # 75
    assert s.admissible_workflows() == 1 + (400 - call) // per == 5
    assert s.stats().admissible_workflows == 5 and s.stats().accepting
    # Typical first calls (50 blocks to max_tokens, more calls to come) arrive one by one.
    for i in range(5):
        assert s.accepting()
        create_request(s, f"w{i}", 16 * 40, max_tokens=16 * 10, workflow_id=f"wf-{i}")
        assert s.kv_headroom() == 400 - (i + 1) * per
    assert s.kv_headroom() == 25 and not s.accepting() and s.admissible_workflows() == 0
    run_step(s)                                         # admitted: the reservation does not change
    assert s.kv_headroom() == 25 and s.admissible_workflows() == 0
    drain(s)
    assert_all_released(s)


def test_admissible_workflows_respects_the_queue_and_sequence_bounds():
    s = create_scheduler(num_blocks=4000, max_waiting_requests=3, max_num_seqs=4,
                         admit_backlog_steps=None)
    assert s.admissible_workflows() == 3                # the queue takes 3 more
    create_request(s, "a", 10, max_tokens=3)
    assert s.admissible_workflows() == 2
    create_request(s, "b0", 10, max_tokens=3)
    create_request(s, "b1", 10, max_tokens=3)
    assert s.admissible_workflows() == 0 and not s.accepting()
    run_step(s)                                         # all three run: one sequence slot left
    assert len(s.running) == 3 and s.admissible_workflows() == 1
    create_request(s, "c", 10, max_tokens=3)
    run_step(s)                                         # the table is full, nothing waits
    assert len(s.running) == 4 and s.admissible_workflows() == 1
    create_request(s, "d", 10, max_tokens=3)            # waits for a sequence slot
    assert s.admissible_workflows() == 0
    drain(s)
    assert s.admissible_workflows() == 3
    assert_all_released(s)


def test_the_headroom_reserves_the_next_call_of_every_workflow_not_at_its_last_step():
    """A workflow whose call is running, or whose KV is retained while it waits on a tool, will
    send another call that adds about a typical call's growth (its new prompt tokens and output,
    a moving average over finished calls of the blocks beyond their prefix hit). That growth is
    kept out of the headroom: otherwise the cache looks roomy exactly while the admitted
    workflows are between calls, and a workflow admitted then evicts their KV."""
    s = create_scheduler(num_blocks=40, retention_ttl_s=100.0)
    g = s.typical_growth_blocks
    assert g == 2                                       # half the starting typical call
    first_prompt = unique_prompt(100)
    create_request(s, "a1", first_prompt, max_tokens=28, ignore_eos=True, workflow_id="wf-a")
    create_request(s, "b1", 100, max_tokens=28, ignore_eos=True, workflow_id="wf-b", is_last_step=True)
    run_step(s)
    # Running: 8 blocks each to max_tokens; only wf-a will call again.
    assert s.kv_headroom() == 40 - 2 * 8 - 1 * g
    drain(s)
    # wf-a is retained between calls (the 7 full blocks of its 127 computed tokens and the tail
    # block with the other 15 pinned: the last sampled token has no KV yet), wf-b ended with its
    # last step.
    wf_a = s.workflows.workflows["wf-a"]
    assert wf_a.retention is not None and len(wf_a.retention.blocks) == 8 and s.workflows.num_retentions == 1
    assert len(wf_a.retention.tail_tokens) == 15
    # Finished calls found nothing cached: each added all its 8 blocks, so the average grew.
    assert s.typical_growth_blocks == round(0.9 * round(0.9 * g + 0.1 * 8) + 0.1 * 8)
    g = s.typical_growth_blocks
    assert s.kv_headroom() == 40 - s.workflows.num_retained_blocks - g
    # Its next call (the conversation so far plus 20 new tokens, 12 to generate: 10 blocks) hits
    # the 7 retained full blocks and takes the tail over (127 tokens cached); it adds only the 3
    # blocks beyond the 7 full ones to the average.
    create_request(s, "a2", first_prompt + [TOKEN] * 28 + unique_prompt(20), max_tokens=12, ignore_eos=True,
                   workflow_id="wf-a", is_last_step=True)
    drain(s)
    assert s.requests == {} and s.workflows.num_retentions == 0
    assert s.typical_growth_blocks == max(1, round(0.9 * g + 0.1 * 3))
    assert s.kv_headroom() == 40
    assert_all_released(s)


def test_the_headroom_reserves_what_an_admitted_workflow_will_grow_to():
    """A workflow grows with every call; admission cannot take back a workflow once admitted, so
    each one not at its last step keeps out of the headroom what it still lacks of a typical
    workflow's final size (the moving average of last calls' blocks), at least one call's growth."""
    s = create_scheduler(num_blocks=400, retention_ttl_s=100.0)
    final, g = s.typical_final_blocks, s.typical_growth_blocks
    assert (final, g) == (50, 25)                      # an eighth of the cache, and half of that
    create_request(s, "a1", 100, max_tokens=28, ignore_eos=True, workflow_id="wf-a")
    run_step(s)
    assert s.kv_headroom() == 400 - 8 - (final - 8)    # 8 blocks at max_tokens, 42 still to come
    drain(s)
    retained = s.workflows.num_retained_blocks
    assert retained == 8 and s.kv_headroom() == 400 - 8 - (final - 8)   # 7 full blocks and the tail
    # A last call of 10 blocks pulls the typical final size down, and with it the reservation.
    create_request(s, "b1", 100, max_tokens=60, ignore_eos=True, workflow_id="wf-b", is_last_step=True)
    drain(s)
    assert s.typical_final_blocks == round(0.9 * final + 0.1 * 10) == 46
    assert s.kv_headroom() == 400 - 8 - (46 - 8)
    s.workflows.release(s.workflows.workflows["wf-a"])
    assert s.kv_headroom() == 400
    assert_all_released(s)


def test_prefill_backlog_counts_prompt_tokens_still_to_compute():
    """Running calls' prefill remainders plus waiting calls' prompts beyond their prefix hits;
    decodes count nothing."""
    s = create_scheduler(max_num_batched_tokens=64, retention_ttl_s=100.0)
    shared = unique_prompt(48)
    a = create_request(s, "a", shared + unique_prompt(52), max_tokens=4, ignore_eos=True)   # 100 tokens
    assert s.prefill_backlog() == 100
    run_step(s)                                          # a computes 64 of its 100
    assert a.num_computed_tokens == 64 and s.prefill_backlog() == 36
    run_step(s)                                          # the rest: a decodes now
    assert a.is_decode and s.prefill_backlog() == 0
    b = create_request(s, "b", shared + unique_prompt(30), max_tokens=4)   # 3 of its blocks cached
    assert s.prefill_backlog() == 78 - 3 * 16
    drain(s)
    assert s.prefill_backlog() == 0
    assert_all_released(s)


def test_no_new_workflows_while_the_prefill_backlog_fills_two_steps():
    """Past `admit_backlog_steps` token budgets of prompt tokens waiting, a new workflow would
    only queue behind them (and put every call after it further back): `accepting` is false
    however much KV is free, and comes back as the backlog is computed."""
    s = create_scheduler(max_num_batched_tokens=100, num_blocks=4000)
    assert s.config.admit_backlog_steps == 2.0
    create_request(s, "a", 150, max_tokens=4, ignore_eos=True)
    assert s.accepting() and s.admissible_workflows() == 1   # room for 50 more: one, see below
    create_request(s, "b", 50, max_tokens=4, ignore_eos=True)
    assert s.prefill_backlog() == 200 and not s.accepting() and s.admissible_workflows() == 0
    run_step(s)                                          # 100 computed: 100 left
    assert s.prefill_backlog() == 100 and s.accepting()
    s.config = dataclasses.replace(s.config, admit_backlog_steps=0.5)
    assert not s.accepting()
    s.config = dataclasses.replace(s.config, admit_backlog_steps=None)
    assert s.accepting()
    drain(s)
    assert_all_released(s)


def test_new_workflows_welcome_at_once_are_capped_by_the_backlog_room():
    """Below the backlog bound, `/load` counts only as many new workflows as the room left under
    it holds typical first prompts (at least one): each is a prompt every call behind it queues
    behind, and the client admits the whole count before it probes again. The typical first
    prompt starts at one token budget and follows the uncached prompt tokens of the first calls
    of workflows (a running average, then weight 0.1); follow-up calls do not move it."""
    s = create_scheduler(max_num_batched_tokens=100, num_blocks=4000, retention_ttl_s=100.0)
    assert s.typical_first_prompt_tokens == 100
    assert s.admissible_workflows() == 2                   # 200 tokens of room, 100 per workflow
    s.config = dataclasses.replace(s.config, admit_backlog_steps=None)
    assert s.admissible_workflows() > 20                   # only the KV bounds it then
    s.config = dataclasses.replace(s.config, admit_backlog_steps=2.0)
    shared = unique_prompt(48)                             # three blocks
    a = create_request(s, "a1", shared + unique_prompt(102), max_tokens=4, ignore_eos=True,
                       workflow_id="a")
    assert a.opens_workflow and s.prefill_backlog() == 150
    assert s.admissible_workflows() == 1                   # 50 of room: still one
    run_step(s)                                            # a1 admitted: 150 uncached tokens
    assert s.typical_first_prompt_tokens == 150 and s.prefill_backlog() == 50
    assert s.admissible_workflows() == 1                   # ceil(150 / 150)
    drain(s)
    assert s.prefill_backlog() == 0 and s.admissible_workflows() == 2   # ceil(200 / 150)
    # A follow-up call of workflow a is not a first prompt, however long.
    a2 = create_request(s, "a2", a.all_token_ids + unique_prompt(400), max_tokens=4,
                        ignore_eos=True, workflow_id="a")
    assert not a2.opens_workflow
    drain(s)
    assert s.typical_first_prompt_tokens == 150
    # Another workflow's first call, its first three blocks cached by a1: 30 tokens to compute.
    b = create_request(s, "b1", shared + unique_prompt(30), max_tokens=4, ignore_eos=True,
                       workflow_id="b")
    assert b.opens_workflow
    drain(s)
    assert b.num_cached_tokens == 48
    assert s.typical_first_prompt_tokens == 150 + (30 - 150) / 2 == 90
    assert s.admissible_workflows() == 3                   # ceil(200 / 90)
    assert_all_released(s)


def test_admit_backlog_steps_is_a_server_flag_and_must_be_positive():
    import argparse

    from sluice.cli import add_engine_args, build_engine_config
    from sluice.config import SchedulerConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config(parser.parse_args([])).scheduler.admit_backlog_steps == 2.0
    cfg = build_engine_config(parser.parse_args(["--admit-backlog-steps", "0.5"]))
    assert cfg.scheduler.admit_backlog_steps == 0.5
    with pytest.raises(ValueError, match="admit_backlog_steps"):
        build_engine_config(parser.parse_args(["--admit-backlog-steps", "0"]))
    assert SchedulerConfig(admit_backlog_steps=None).admit_backlog_steps is None


def test_max_active_workflows_bounds_admissions_until_a_workflow_ends():
    """With `max_active_workflows`, `/load` welcomes new workflows only up to the bound, counting
    a workflow in flight while a call of it runs or waits and while its KV is retained for the
    next call; a workflow that ends (its last step finished) makes room again."""
    s = create_scheduler(num_blocks=4000, retention_ttl_s=100.0, max_active_workflows=2)
    assert s.admissible_workflows() == 2
    create_request(s, "a1", 40, max_tokens=4, ignore_eos=True, workflow_id="a")
    assert s.admissible_workflows() == 1
    create_request(s, "b1", 40, max_tokens=4, ignore_eos=True, workflow_id="b", is_last_step=True)
    assert s.admissible_workflows() == 0 and not s.accepting()
    drain(s)
    # a is between calls with its KV retained: still in flight; b said it was done.
    assert s.workflows.workflows["a"].retention is not None
    assert s.workflows.num_active == 1 and s.admissible_workflows() == 1
    create_request(s, "a2", 60, max_tokens=4, ignore_eos=True, workflow_id="a", is_last_step=True)
    assert s.workflows.num_active == 1
    drain(s)
    assert s.workflows.num_active == 0 and s.admissible_workflows() == 2
    s.workflow_limit = WorkflowLimit()       # no bound
    assert s.admissible_workflows() > 2
    assert_all_released(s)


def test_max_active_workflows_and_its_band_are_server_flags_auto_by_default_and_validated():
    import argparse

    from sluice.cli import add_engine_args, build_engine_config
    from sluice.config import SchedulerConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config(parser.parse_args([])).scheduler.max_active_workflows == "auto"
    assert SchedulerConfig().max_active_workflows == "auto"
    cfg = build_engine_config(parser.parse_args(["--max-active-workflows", "16"]))
    assert cfg.scheduler.max_active_workflows == 16
    cfg = build_engine_config(parser.parse_args(["--max-active-workflows", "none"]))
    assert cfg.scheduler.max_active_workflows is None
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-active-workflows", bad])
    for bad in (0, "eight", 2.5):
        with pytest.raises(ValueError, match="max_active_workflows"):
            SchedulerConfig(max_active_workflows=bad)
    assert build_engine_config(parser.parse_args([])).scheduler.auto_overhead_band is None
    cfg = build_engine_config(parser.parse_args(["--auto-overhead-band", "0.05,0.08"]))
    assert cfg.scheduler.auto_overhead_band == (0.05, 0.08)
    for bad in ("0.2,0.1", "0,0.1", "0.1,1", "0.1", "low,high"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--auto-overhead-band", bad])
    with pytest.raises(ValueError, match="auto_overhead_band"):
        SchedulerConfig(auto_overhead_band=(0.3, 0.2))
    for bound in (8, None):
        with pytest.raises(ValueError, match="auto_overhead_band"):
            SchedulerConfig(max_active_workflows=bound, auto_overhead_band=(0.05, 0.08))
    # --auto-step-ratio: not given, the config's default cap; none, no cap
    assert build_engine_config(parser.parse_args([])).scheduler.auto_step_ratio == SchedulerConfig().auto_step_ratio
    assert build_engine_config(parser.parse_args(["--auto-step-ratio", "none"])).scheduler.auto_step_ratio is None
    cfg = build_engine_config(parser.parse_args(["--auto-step-ratio", "0.5,1.5"]))
    assert cfg.scheduler.auto_step_ratio == (0.5, 1.5)
    for bad in ("1.0,0.8", "0,1", "0.8", "low,high"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--auto-step-ratio", bad])
    with pytest.raises(ValueError, match="auto_step_ratio"):
        SchedulerConfig(auto_step_ratio=(1.0, 0.8))


def test_a_full_sequence_table_with_a_queue_is_not_welcoming():
    s = create_scheduler(max_num_seqs=1)
    create_request(s, "a", 10, max_tokens=3)
    create_request(s, "b", 10, max_tokens=3)
    run_step(s)
    assert len(s.running) == 1 and s.waiting and not s.accepting()
    drain(s)
    assert s.accepting()
