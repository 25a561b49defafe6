"""Scheduler ("engine core") tests with hand-built model outputs: chunked prefill on a token
budget, decode-first ordering, prefix caching, eviction, preemption, stops and aborts."""
from __future__ import annotations

import pytest

from sched_utils import (
    no_waiting_for_blocks,
    EOS,
    TOKEN,
    assert_all_released,
    create_request,
    create_requests,
    create_scheduler,
    drain,
    run_step,
    scheduled_ids,
    unique_prompt,
)
from sluice.engine.errors import RequestRejected
from sluice.engine.request import RequestStatus
from sluice.engine.scheduler import Scheduler


def by_output_index(req) -> int:
    """Token i of a request's output is 100 + i: a resumed request must continue the sequence."""
    return 100 + req.num_output_tokens


# --- chunked prefill and the token budget -----------------------------------------------------
def test_chunked_prefill_boundaries():
    s = create_scheduler(max_num_batched_tokens=32)
    (req,) = create_requests(s, 1, prompt=100, max_tokens=3)
    chunks, samples = [], []
    for _ in range(4):
        out, updated = run_step(s)
        chunks += [n for _, n in out.scheduled]
        samples += out.samples
        assert updated == ([req] if out.samples[0] else [])
    assert chunks == [32, 32, 32, 4]
    assert samples == [False, False, False, True]
    assert req.num_computed_tokens == 100 and req.output_token_ids == [TOKEN]

    out, _ = run_step(s)
    assert scheduled_ids(out) == [("r0", 1)] and out.samples == [True]
    drain(s)
    assert req.output_token_ids == [TOKEN] * 3 and req.status is RequestStatus.FINISHED_LENGTH
    assert_all_released(s)


def test_decodes_go_before_prefill_chunks():
    """Without decode yields, a running decode gets its token every step, even when the prefill
    has the better priority."""
    s = create_scheduler(max_num_batched_tokens=32, decode_yield_steps=0)
    s.clock.advance(10)
    decode = create_request(s, "decode", 10, max_tokens=20)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("decode", 10)]

    # Arrived earlier (FCFS would put it first), but it is a prefill.
    long = create_request(s, "long", 100, max_tokens=1, arrival_time=0.0)
    chunks = []
    while not long.output_token_ids:
        out, _ = run_step(s)
        assert out.scheduled[0] == (decode, 1) and out.samples[0]
        chunks.append(dict(scheduled_ids(out)).get("long"))
    assert chunks == [31, 31, 31, 7]
    assert decode.num_output_tokens == 5
    drain(s)
    assert_all_released(s)


def test_long_prefill_leaves_every_decode_its_token():
    s = create_scheduler(max_num_batched_tokens=16, decode_yield_steps=0)
    decodes = create_requests(s, 4, prompt=3, max_tokens=10, prefix="d")
    run_step(s)
    create_request(s, "long", 60, max_tokens=1)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("d0", 1), ("d1", 1), ("d2", 1), ("d3", 1), ("long", 12)]
    assert out.num_batched_tokens == 16
    assert all(d.num_output_tokens == 2 for d in decodes)
    drain(s)
    assert_all_released(s)


def test_decodes_yield_every_other_step_to_waiting_prompts():
    """By default a waiting prompt gets a step alone (the whole budget, no decode pass), then
    the decodes come back: they never sit out two steps in a row."""
    s = create_scheduler(max_num_batched_tokens=32)
    assert s.config.decode_yield_steps == 1
    decodes = create_requests(s, 2, prompt=10, max_tokens=20, prefix="d")
    run_step(s)
    long = create_request(s, "long", 100, max_tokens=2)
    steps = []
    while not long.output_token_ids:
        out, _ = run_step(s)
        steps.append(scheduled_ids(out))
    assert steps == [[("long", 32)], [("d0", 1), ("d1", 1), ("long", 30)],
                     [("long", 32)], [("d0", 1), ("d1", 1), ("long", 6)]]
    assert s.stats().decode_yield_steps == 2
    # Decoding, `long` is a decode like the others: nothing waits, nothing yields.
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("d0", 1), ("d1", 1), ("long", 1)]
    assert all(d.num_output_tokens == 4 for d in decodes)
    drain(s)
    assert_all_released(s)


@pytest.mark.parametrize("yields", [2, 3])
def test_decode_yield_steps_bounds_the_consecutive_yields(yields):
    s = create_scheduler(max_num_batched_tokens=16, decode_yield_steps=yields)
    d = create_request(s, "d", 4, max_tokens=30, ignore_eos=True)
    run_step(s)
    create_request(s, "long", 200, max_tokens=1)
    with_decode = []
    while s.waiting or any(not r.is_decode for r in s.running):
        out, _ = run_step(s)
        with_decode.append(d in [r for r, _ in out.scheduled])
    pattern = ([False] * yields + [True]) * len(with_decode)
    assert with_decode == pattern[:len(with_decode)] and len(with_decode) > yields + 1
    drain(s)
    assert_all_released(s)


def test_decodes_do_not_yield_to_prompts_that_cannot_run():
    """A waiting prompt with no sequence slot (max_num_seqs) cannot use the step: the decodes
    take it as usual, rather than leave it empty."""
    s = create_scheduler(max_num_seqs=1)
    d = create_request(s, "d", 4, max_tokens=3)
    run_step(s)
    create_request(s, "late", 8, max_tokens=1)
    for _ in range(2):
        out, _ = run_step(s)
        assert scheduled_ids(out) == [("d", 1)]
    assert d.is_finished
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("late", 8)]
    assert_all_released(s)


def test_requests_share_the_step_budget():
    s = create_scheduler(max_num_batched_tokens=32, decode_yield_steps=0)
    create_requests(s, 3, prompt=20, max_tokens=2)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("r0", 20), ("r1", 12)]
    assert out.samples == [True, False]
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("r0", 1), ("r1", 8), ("r2", 20)]
    assert out.samples == [True, True, True]
    assert out.num_batched_tokens == 29
    drain(s)
    assert_all_released(s)


def test_max_num_seqs_bounds_the_batch():
    s = create_scheduler(max_num_seqs=2)
    reqs = create_requests(s, 3, prompt=5, max_tokens=2)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("r0", 5), ("r1", 5)]
    assert reqs[2].status is RequestStatus.WAITING and len(s.waiting) == 1
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("r0", 1), ("r1", 1)]
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("r2", 5)]
    drain(s)
    assert all(r.num_output_tokens == 2 for r in reqs)
    assert_all_released(s)


# --- prefix caching -----------------------------------------------------------------------------
def test_prefix_cache_hit():
    s = create_scheduler(block_size=16, decode_yield_steps=0)
    prefix = unique_prompt(48)
    first = create_request(s, "first", prefix + unique_prompt(10), max_tokens=3)
    run_step(s)
    assert first.num_cached_tokens == 0
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (58, 0)

    # While `first` still runs, its three full prompt blocks are shared.
    second = create_request(s, "second", prefix + unique_prompt(7), max_tokens=2)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("first", 1), ("second", 7)]
    assert second.num_cached_tokens == 48
    assert second.blocks[:3] == first.blocks[:3]
    assert all(b.ref_cnt == 2 for b in first.blocks[:3])
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (58 + 55, 48)
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (113, 48)
    drain(s)

    # The whole prompt is cached, but one token must be computed for its logits.
    third = create_request(s, "third", prefix, max_tokens=1)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("third", 16)]
    assert third.num_cached_tokens == 32
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (113 + 48, 48 + 32)
    assert_all_released(s)


def test_prefix_cache_hit_on_a_partial_chunked_prompt():
    """Blocks are cached as chunks complete, so a request admitted mid-prefill of another hits them."""
    s = create_scheduler(block_size=16, max_num_batched_tokens=32)
    prefix = unique_prompt(64)
    create_request(s, "a", prefix + unique_prompt(36), max_tokens=1)
    run_step(s)
    run_step(s)       # `a` has computed 64 tokens: four full blocks cached
    b = create_request(s, "b", prefix + unique_prompt(4), max_tokens=1)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("a", 32)]           # budget spent on `a`
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("a", 4), ("b", 4)]
    assert b.num_cached_tokens == 64
    drain(s)
    assert_all_released(s)


def test_no_prefix_cache_hit_when_caching_disabled():
    s = create_scheduler(enable_prefix_caching=False)
    prefix = unique_prompt(48)
    create_request(s, "a", prefix + [1], max_tokens=1)
    drain(s)
    b = create_request(s, "b", prefix + [3], max_tokens=1)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("b", 49)] and b.num_cached_tokens == 0
    assert s.pool.num_evictable_blocks == 0
    assert_all_released(s)


def test_cached_blocks_are_evicted_tail_first_under_pressure():
    s = create_scheduler(block_size=16, num_blocks=8)
    prompt = unique_prompt(48)
    create_request(s, "a", prompt, max_tokens=1)
    drain(s)
    assert s.pool.num_evictable_blocks == 3

    # Needs 7 of the 8 blocks: two of a's cached blocks are reused, its last ones first.
    create_request(s, "big", 100, max_tokens=1)
    drain(s)
    c = create_request(s, "c", prompt + unique_prompt(4), max_tokens=1)
    out, _ = run_step(s)
    assert c.num_cached_tokens == 16
    assert scheduled_ids(out) == [("c", 36)]
    drain(s)
    assert_all_released(s)


def test_unreferenced_cached_blocks_do_not_block_admission():
    s = create_scheduler(block_size=16, num_blocks=8)
    for i in range(4):
        create_request(s, f"old{i}", 32, max_tokens=1)
    drain(s)
    assert s.pool.num_evictable_blocks == 8
    big = create_request(s, "big", 120, max_tokens=1)
    out, _ = run_step(s)
    assert scheduled_ids(out) == [("big", 120)] and big.is_finished
    assert s.pool.num_evictable_blocks == 7
    assert_all_released(s)


# --- preemption ---------------------------------------------------------------------------------
def test_preemption_and_resume():
    s = create_scheduler(block_size=4, num_blocks=8)
    r0 = create_request(s, "r0", 8, max_tokens=12, ignore_eos=True)
    s.clock.advance(1)
    r1 = create_request(s, "r1", 8, max_tokens=12, ignore_eos=True)
    preempted_at = None
    for step in range(100):
        if not s.has_unfinished():
            break
        out, _ = run_step(s, by_output_index)
        if out.preempted:
            assert out.preempted == [r1]                   # the later arrival is the victim
            assert scheduled_ids(out) == [("r0", 1)]       # nothing is admitted in that step
            assert r1.status is RequestStatus.PREEMPTED and r1.blocks == []
            assert r1.num_computed_tokens == 0 and r1 in s.waiting and r1.protected
            preempted_at = r1.num_output_tokens
    assert preempted_at is not None and 0 < preempted_at < 12
    assert r1.num_preemptions == 1 and s.num_preemptions == 1 and s.stats().num_preemptions == 1
    for r in (r0, r1):
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [100 + i for i in range(12)]
    assert_all_released(s)


@pytest.mark.parametrize("policy", ["fcfs", "workflow"])
def test_priority_goes_first_and_is_preempted_last(policy):
    """vLLM's request priority: a later call with a lower value is admitted first (the step's
    budget holds one prompt), and when memory runs out the victim is the higher value's."""
    s = create_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=8, policy=policy,
                         decode_yield_steps=0)
    low = create_request(s, "low", 8, max_tokens=12, ignore_eos=True, priority=1)
    s.clock.advance(1)
    high = create_request(s, "high", 8, max_tokens=12, ignore_eos=True, priority=-1)
    out, _ = run_step(s, by_output_index)
    assert scheduled_ids(out) == [("high", 8)]
    preempted = []
    while s.has_unfinished():
        out, _ = run_step(s, by_output_index)
        preempted += out.preempted
    assert preempted and set(preempted) == {low}
    assert high.num_preemptions == 0 and high.output_token_ids == low.output_token_ids == [100 + i for i in range(12)]
    assert_all_released(s)


def r0_at_a_block_boundary(r1_max_tokens: int):
    """Five 4-token blocks, all taken after five steps: r0 (first in line) has computed 8 tokens
    in 2 blocks and needs a third for its next one; r1 has computed 10 in 3 blocks (2 slots left)."""
    s = create_scheduler(block_size=4, num_blocks=5, retention_ttl_s=0)
    r0 = create_request(s, "r0", 4, max_tokens=12, ignore_eos=True)
    s.clock.advance(1)
    r1 = create_request(s, "r1", 6, max_tokens=r1_max_tokens, ignore_eos=True)
    for _ in range(5):
        run_step(s, by_output_index)
    return s, r0, r1


def test_request_short_of_a_block_waits_while_others_progress():
    """r0 (first in line) reaches a block boundary with no block free while r1 still has a slot in
    its own blocks: r0 waits a step instead of preempting r1, and r1's finish frees the memory.
    Preempting at the first shortage would have thrown away r1's computed tokens."""
    s, r0, r1 = r0_at_a_block_boundary(r1_max_tokens=6)
    assert s.pool.num_free_blocks == 0 and (r0.num_computed_tokens, r1.num_computed_tokens) == (8, 10)
    out, _ = run_step(s, by_output_index)     # r0 needs its third block; r1 has slots 11-12
    assert scheduled_ids(out) == [("r1", 1)] and not out.preempted
    assert r0.deferred_steps == 1 and r0.status is RequestStatus.RUNNING and r1.is_finished
    out, _ = run_step(s, by_output_index)     # r1's blocks are free again
    assert scheduled_ids(out) == [("r0", 1)] and r0.deferred_steps == 0
    drain(s, by_output_index)
    assert r0.output_token_ids == [100 + i for i in range(12)]
    assert r1.output_token_ids == [100 + i for i in range(6)]
    assert s.num_preemptions == 0
    assert_all_released(s)


def test_waiting_for_a_block_is_bounded(monkeypatch):
    """The same start with r1 far from done: after MAX_DEFER_STEPS waits, r0 preempts r1."""
    monkeypatch.setattr(Scheduler, "MAX_DEFER_STEPS", 1)
    s, r0, r1 = r0_at_a_block_boundary(r1_max_tokens=12)
    out, _ = run_step(s, by_output_index)
    assert scheduled_ids(out) == [("r1", 1)] and r0.deferred_steps == 1
    out, _ = run_step(s, by_output_index)     # r1 still has a slot, but r0 has waited enough
    assert out.preempted == [r1] and scheduled_ids(out) == [("r0", 1)]
    drain(s, by_output_index)
    assert r0.output_token_ids == [100 + i for i in range(12)]
    assert r1.output_token_ids == [100 + i for i in range(12)]
    assert s.num_preemptions == 1
    assert_all_released(s)


def test_prefill_chunk_shrinks_to_the_slots_left():
    """A running prefill whose next chunk needs a block none can give computes what fits in the
    blocks it holds, instead of preempting or waiting."""
    s = create_scheduler(block_size=4, num_blocks=6, max_num_batched_tokens=9, retention_ttl_s=0,
                         decode_yield_steps=0)
    r0 = create_request(s, "r0", 4, max_tokens=12, ignore_eos=True)
    r1 = create_request(s, "r1", 20, max_tokens=2, ignore_eos=True)
    out, _ = run_step(s, by_output_index)
    assert scheduled_ids(out) == [("r0", 4), ("r1", 5)]
    out, _ = run_step(s, by_output_index)
    assert scheduled_ids(out) == [("r0", 1), ("r1", 8)] and s.pool.num_free_blocks == 0
    out, _ = run_step(s, by_output_index)     # r1's 7 remaining tokens need a 5th block
    assert scheduled_ids(out) == [("r0", 1), ("r1", 3)] and not out.preempted
    drain(s, by_output_index)
    assert r0.output_token_ids == [100 + i for i in range(12)]
    assert r1.output_token_ids == [100, 101]
    assert_all_released(s)


def test_resumed_request_recomputes_from_the_prefix_cache():
    s = create_scheduler(block_size=4, num_blocks=8)
    create_request(s, "r0", 8, max_tokens=12, ignore_eos=True)
    s.clock.advance(1)
    r1 = create_request(s, "r1", 8, max_tokens=12, ignore_eos=True)
    while not r1.num_preemptions:
        run_step(s, by_output_index)
    num_tokens = r1.num_tokens
    while r1.status is not RequestStatus.RUNNING:
        out, _ = run_step(s, by_output_index)
    (n,) = [n for r, n in out.scheduled if r is r1]
    assert r1.num_computed_tokens == num_tokens     # prompt and outputs recomputed in one step
    assert 0 < n < num_tokens and (num_tokens - n) % 4 == 0   # the rest were whole-block hits
    assert r1.num_cached_tokens == 0                # hit accounting is for the first admission
    drain(s, by_output_index)
    assert r1.output_token_ids == [100 + i for i in range(12)]
    assert_all_released(s)


def test_scheduled_request_is_withdrawn_when_it_is_the_victim(monkeypatch):
    """Equal priorities: `solo` needs a block that `filler` just took this step; `filler` has less
    progress to lose, so it is withdrawn from the batch and preempted, and both finish."""
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    s = create_scheduler(block_size=4, num_blocks=6, retention_ttl_s=0)
    filler = create_request(s, "filler", 8, max_tokens=4, ignore_eos=True)
    solo = create_request(s, "solo", 12, max_tokens=8, ignore_eos=True)
    run_step(s, by_output_index)
    out, _ = run_step(s, by_output_index)
    assert out.preempted == [filler] and scheduled_ids(out) == [("solo", 1)] and out.samples == [True]
    assert out.num_batched_tokens == 1
    drain(s, by_output_index)
    assert solo.output_token_ids == [100 + i for i in range(8)]
    assert filler.output_token_ids == [100 + i for i in range(4)]
    assert (filler.num_preemptions, solo.num_preemptions) == (1, 0)
    assert_all_released(s)


def test_request_that_can_never_fit_is_rejected():
    s = create_scheduler(block_size=16, num_blocks=4, max_model_len=100)
    with pytest.raises(RequestRejected) as e:
        s.check_fits(90, 20)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestRejected) as e:
        s.check_fits(60, 10)                         # 70 tokens: 5 blocks of a 4-block cache
    assert e.value.status_code == 400
    s.check_fits(54, 10)                             # exactly 4 blocks fits
    req = create_request(s, "fits", 54, max_tokens=10, ignore_eos=True)
    drain(s)
    assert req.num_output_tokens == 10
    assert_all_released(s)


# --- stop conditions ----------------------------------------------------------------------------
def emit_at(index: int, token: int):
    return lambda req: token if req.num_output_tokens == index else TOKEN


def test_stop_on_eos():
    s = create_scheduler()
    (req,) = create_requests(s, 1, max_tokens=10)
    drain(s, emit_at(2, EOS))
    assert req.output_token_ids == [TOKEN, TOKEN, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert_all_released(s)


def test_stop_on_stop_token_id():
    s = create_scheduler()
    (req,) = create_requests(s, 1, max_tokens=10, stop_token_ids=[9])
    drain(s, emit_at(3, 9))
    assert req.output_token_ids == [TOKEN] * 3 + [9]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    assert_all_released(s)


def test_stop_on_max_tokens():
    s = create_scheduler()
    (req,) = create_requests(s, 1, max_tokens=5)
    drain(s)
    assert req.output_token_ids == [TOKEN] * 5
    assert req.status is RequestStatus.FINISHED_LENGTH and req.stop_reason is None
    assert_all_released(s)


def test_stop_at_max_model_len():
    s = create_scheduler(max_model_len=16)
    (req,) = create_requests(s, 1, prompt=12, max_tokens=100)
    drain(s)
    assert req.num_tokens == 16 and req.status is RequestStatus.FINISHED_LENGTH
    assert_all_released(s)


def test_min_tokens_defers_stops():
    s = create_scheduler()
    (req,) = create_requests(s, 1, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    assert set(req.suppressed_token_ids()) == {9, EOS}
    drain(s, lambda r: EOS if r.num_output_tokens < 2 else 9)
    assert req.output_token_ids == [EOS, EOS, 9]     # the third token reaches min_tokens
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    assert req.suppressed_token_ids() == ()
    assert_all_released(s)


def test_ignore_eos():
    s = create_scheduler()
    (req,) = create_requests(s, 1, max_tokens=4, ignore_eos=True)
    assert req.suppressed_token_ids() == ()
    drain(s, lambda r: EOS)
    assert req.output_token_ids == [EOS] * 4 and req.status is RequestStatus.FINISHED_LENGTH
    assert_all_released(s)


def test_ignore_eos_still_stops_on_stop_token_ids():
    s = create_scheduler()
    (req,) = create_requests(s, 1, max_tokens=4, ignore_eos=True, stop_token_ids=[EOS])
    drain(s, lambda r: EOS)
    assert req.output_token_ids == [EOS] and req.stop_reason == EOS
    assert_all_released(s)


# --- aborts -------------------------------------------------------------------------------------
def test_abort_while_waiting():
    s = create_scheduler(max_num_seqs=1)
    running, waiting = create_requests(s, 2, max_tokens=3)
    run_step(s)
    assert s.abort_request("r1") is waiting
    assert waiting.status is RequestStatus.FINISHED_ABORTED and waiting not in s.waiting
    assert s.abort_request("r1") is None and s.abort_request("nope") is None
    s.check_invariants()
    drain(s)
    assert running.num_output_tokens == 3 and waiting.num_output_tokens == 0
    assert_all_released(s)


def test_abort_while_running():
    s = create_scheduler()
    a, b = create_requests(s, 2, prompt=40, max_tokens=10)
    run_step(s)
    assert a.blocks
    assert s.abort_request("r0") is a
    assert a.status is RequestStatus.FINISHED_ABORTED and a.blocks == [] and a not in s.running
    s.check_invariants()
    drain(s)
    assert b.num_output_tokens == 10
    assert_all_released(s)


def test_abort_between_schedule_and_update():
    """A request aborted while its step runs gets nothing; the others still get their own tokens."""
    s = create_scheduler()
    a, b = create_requests(s, 2, max_tokens=5)
    out = s.schedule()
    s.abort_request("r0")
    updated = s.update_from_output(out, [11, 12])
    assert updated == [b] and b.output_token_ids == [12] and a.output_token_ids == []
    s.check_invariants()
    drain(s)
    assert_all_released(s)


def test_abort_of_preempted_request():
    s = create_scheduler(block_size=4, num_blocks=8)
    create_request(s, "r0", 8, max_tokens=12, ignore_eos=True)
    s.clock.advance(1)
    r1 = create_request(s, "r1", 8, max_tokens=12, ignore_eos=True)
    while r1.status is not RequestStatus.PREEMPTED:
        run_step(s)
    assert s.abort_request("r1") is r1 and r1 not in s.waiting
    drain(s)
    assert_all_released(s)
