"""Prompt-lookup speculative decoding: drafting, verification, and the scheduler's books with
hand-built model outputs (the model-level checks against transformers are in
test_model_smollm2.py)."""
from __future__ import annotations

import pytest

from sched_utils import EOS, TOKEN, assert_all_released, create_request, create_scheduler, drain, run_step
from sluice.cli import parse_speculative_config
from sluice.config import SpeculativeConfig
from sluice.engine.request import RequestStatus
from sluice.engine.spec_decode import NgramIndex, PredictedOutput, accept

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)


# --- drafting ----------------------------------------------------------------------------------
def test_draft_copies_what_followed_the_most_recent_occurrence():
    idx = NgramIndex(2, 3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    toks = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 1, 2]
    # suffix (1, 2): occurrences at 0 and 5; the latest is followed by 3, 9, 8, 1
    assert idx.propose(toks, 4) == [3, 9, 8, 1]
    assert idx.propose(toks, 2) == [3, 9]


def test_longest_ngram_wins():
    idx = NgramIndex(1, 3)
    # suffix 3-gram (7, 8, 9) occurs at 0 (followed by 1); the 1-gram 9 last occurs at 6 (followed by 5)
    toks = [7, 8, 9, 1, 0, 0, 9, 5, 0, 7, 8, 9]
    assert idx.propose(toks, 1) == [1]
    assert NgramIndex(1, 1).propose(toks, 1) == [5]


def test_no_match_no_draft():
    idx = NgramIndex(2, 3)
    assert idx.propose([1, 2, 3, 4, 5], 4) == []
    assert idx.propose([1], 4) == []
    assert idx.propose([1, 2, 1, 2], 0) == []


def test_copy_runs_into_its_own_draft_for_short_loops():
    # A loop of period 2: the latest earlier (5, 6) is two tokens back, yet k drafts come out.
    idx = NgramIndex(2, 2)
    assert idx.propose([0, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]
    # period 1
    assert NgramIndex(2, 3).propose([4, 4, 4], 3) == [4, 4, 4]


def test_index_grows_incrementally_and_agrees_with_a_scan():
    import random

    rnd = random.Random(0)
    toks: list[int] = []
    idx = NgramIndex(2, 4)
    for _ in range(400):
        toks.append(rnd.choice([1, 2, 3, 4]))
        got = idx.propose(toks, 3)
        expected: list[int] = []
        for n in range(4, 1, -1):  # brute force: latest earlier occurrence, longest n first
            if len(toks) < n + 1:
                continue
            starts = [s for s in range(len(toks) - n) if toks[s:s + n] == toks[-n:]]
            if starts:
                seq = list(toks)
                p = starts[-1] + n
                for j in range(3):
                    seq.append(seq[p + j])
                expected = seq[len(toks):]
                break
        assert got == expected, (toks, got, expected)


def test_a_prediction_is_drafted_where_the_output_follows_it():
    #                     0   1   2   3   4   5   6   7   8   9
    pred = PredictedOutput([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 2, 3)
    assert pred.propose([], 3) == [10, 11, 12]            # nothing out yet: the prediction's start
    assert pred.propose([10, 11], 3) == [12, 13, 14]      # the output follows it
    # the output departs (an edit: 99 for 12, 13) and rejoins: found again at (14, 15)
    assert pred.propose([10, 11, 99], 3) == []            # lost, and no n-gram of it to find
    assert pred.propose([10, 11, 99, 98, 14, 15], 3) == [16, 17, 18]
    assert pred.propose([10, 11, 99, 98, 14, 15, 16, 17, 18, 19], 3) == []   # the prediction is used up


def test_a_lost_prediction_is_found_again_ahead_of_where_it_was():
    # (1, 2) occurs at 0 and at 4: once the output has passed 4, an output ending in (1, 2) realigns at 6
    pred = PredictedOutput([1, 2, 7, 8, 1, 2, 5, 6, 1, 2, 3], 2, 2)
    assert pred.propose([1, 2, 7, 8, 1, 2, 5], 2) == [6, 1]
    assert pred.propose([1, 2, 7, 8, 1, 2, 5, 0, 1, 2], 3) == [3]    # at 10, not back at 2 or 6
    fresh = PredictedOutput([1, 2, 7, 8, 1, 2, 5], 2, 2)
    assert fresh.propose([9, 9, 1, 2], 2) == [7, 8]                  # from the start, the first one ahead


def test_accept():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]   # all accepted, plus the bonus token
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]          # rejected at 1: the model's token there
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept([], [3]) == [3]


def test_config_parsing():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("none") is None
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (5, 2, 4)
    assert parse_speculative_config('{"prompt_lookup_max": 1}').prompt_lookup_min == 1
    for bad in ['{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}', '{"draft_model": "x"}', "[1]", "{"]:
        with pytest.raises(ValueError):
            parse_speculative_config(bad)


# --- the scheduler -----------------------------------------------------------------------------
def _decoding(s, req, token=TOKEN):
    """Run until `req` decodes (its prefill done, one token sampled)."""
    while req.num_output_tokens == 0:
        run_step(s, lambda r: token)


def test_decode_carries_drafts_and_counts_only_accepted_tokens():
    s = create_scheduler(speculative=SPEC, block_size=4)
    req = create_request(s, "a", [11, 12, 13, 11, 12], max_tokens=50)
    _decoding(s, req, token=13)          # 11 12 13 11 12 | 13: suffix (12, 13) seen at 1, drafts 11 12 13 11
    out = s.schedule()
    assert out.spec_tokens == {"a": [11, 12, 13, 11]}
    assert out.scheduled == [(req, 5)] and out.samples == [True] and out.num_batched_tokens == 5
    assert len(req.blocks) == 3         # slots for positions 5..9
    # The model agrees with two drafts, then picks 7 instead of 13.
    [updated] = s.update_from_output(out, [[11, 12, 7]])
    assert updated is req and req.num_new_tokens == 3
    assert req.output_token_ids == [13, 11, 12, 7]
    assert req.num_computed_tokens == req.num_tokens - 1 == 8   # input token + 2 accepted drafts
    assert len(req.blocks) == 3         # blocks_for(9): the rejected drafts' slots are given back
    assert (s.spec_drafts_total, s.spec_draft_tokens_total, s.spec_accepted_tokens_total) == (1, 4, 2)
    s.check_invariants()
    st = s.stats()
    assert (st.spec_draft_tokens_total, st.spec_accepted_tokens_total) == (4, 2)


def test_rejected_drafts_free_their_extra_block():
    s = create_scheduler(speculative=SPEC, block_size=2)
    req = create_request(s, "a", [11, 12, 13, 11, 12, 13, 11], max_tokens=50)
    _decoding(s, req, token=12)         # 8 tokens in 4 blocks of 2; 4 drafts need 2 more
    free = s.pool.num_free_blocks
    out = s.schedule()
    assert out.spec_tokens["a"] == [13, 11, 12, 13] and len(req.blocks) == 6
    s.update_from_output(out, [[15]])    # nothing accepted: 9 tokens need 5 blocks
    assert req.num_tokens == 9 and len(req.blocks) == 5 and s.pool.num_free_blocks == free - 1
    s.check_invariants()
    out = s.schedule()
    s.update_from_output(out, [[*out.spec_tokens.get("a", []), 16]])
    s.check_invariants()
    drain(s)
    assert_all_released(s)


def test_drafts_respect_max_tokens_and_model_len():
    s = create_scheduler(speculative=SPEC, max_model_len=64)
    req = create_request(s, "a", [14] * 10, max_tokens=3, ignore_eos=True)
    _decoding(s, req, token=14)
    out = s.schedule()
    assert out.spec_tokens["a"] == [14]            # 2 more tokens allowed: 1 + 1 draft
    s.update_from_output(out, [[14, 14]])
    assert req.is_finished and req.status is RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 3

    req = create_request(s, "b", [15] * 58, max_tokens=6, ignore_eos=True)
    _decoding(s, req, token=15)                     # 59 tokens; the context ends at 64
    out = s.schedule()
    assert out.spec_tokens["b"] == [15] * 4
    s.update_from_output(out, [[15] * 5])
    assert req.is_finished and req.num_tokens == 64
    assert_all_released(s)


def test_stop_token_inside_the_accepted_run_ends_the_request_there():
    s = create_scheduler(speculative=SPEC)
    req = create_request(s, "a", [11, EOS, 13, 11, EOS], max_tokens=20, stop_token_ids=[19])
    _decoding(s, req, token=13)        # ... 11 EOS | 13: suffix (EOS, 13) at 1, drafts 11 EOS 13 11
    out = s.schedule()
    assert out.spec_tokens["a"] == [11, EOS, 13, 11]
    s.update_from_output(out, [[11, EOS, 13, 11, 18]])
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids == [13, 11, EOS]     # nothing after the EOS
    assert_all_released(s)


def test_drafts_use_only_the_budget_left_after_decodes_and_prefills():
    s = create_scheduler(speculative=SPEC, max_num_batched_tokens=8)
    reqs = [create_request(s, f"r{i}", [11, 12, 11, 12], max_tokens=30, ignore_eos=True) for i in range(3)]
    pattern = lambda r: r.all_token_ids[-2]  # noqa: E731 -- continues the period-2 loop
    while any(r.num_output_tokens == 0 for r in reqs):
        run_step(s, pattern)
    out = s.schedule()
    # three decodes take 3 of 8; the 5 left go to drafts in decode order: 4, then 1
    assert [n for _, n in out.scheduled] == [5, 2, 1] and out.num_batched_tokens == 8
    s.update_from_output(out, [[*out.spec_tokens.get(r.request_id, []), pattern(r)] for r, _ in out.scheduled])
    # a waiting prompt takes the budget before any draft does: first a step of its own (the
    # decodes yield), then the decodes' tokens and the rest of the budget
    late = create_request(s, "late", 20, max_tokens=4)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("late", 8)]
    assert out.spec_tokens == {}
    s.update_from_output(out, [])
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 1), ("r1", 1), ("r2", 1), ("late", 5)]
    assert out.spec_tokens == {}
    s.update_from_output(out, [pattern(r) for r, _ in out.scheduled[:3]])
    drain(s, pattern)
    assert late.is_finished
    assert_all_released(s)


def test_drafts_never_take_the_blocks_others_need():
    # 6 blocks of 4: two requests of 8 + 4 tokens need 3 each; no block is spare for drafts.
    s = create_scheduler(speculative=SPEC, block_size=4, num_blocks=6, policy="fcfs")
    a = create_request(s, "a", [11, 12, 11, 12, 11, 12, 11, 12], max_tokens=4, ignore_eos=True)
    b = create_request(s, "b", [13, 14, 13, 14, 13, 14, 13, 14], max_tokens=4, ignore_eos=True)
    while a.num_output_tokens == 0 or b.num_output_tokens == 0:
        run_step(s, lambda r: r.all_token_ids[-2])
    assert s.pool.num_free_blocks == 2 and len(a.blocks) == len(b.blocks) == 2
    out = s.schedule()
    # Each decode needs its third block; its drafts fit in what that block has left (and in
    # max_tokens: 3 more tokens, so 2 drafts). No fourth block, no preemption.
    assert out.spec_tokens == {"a": [12, 11], "b": [14, 13]}
    assert not out.preempted and s.pool.num_free_blocks == 0
    s.update_from_output(out, [[12, 11, 12], [14, 13, 14]])
    assert a.is_finished and b.is_finished and s.num_preemptions == 0
    assert_all_released(s)


def test_drafts_stop_at_the_last_block_when_blocks_are_short():
    # Three decodes of 9 tokens, 10 blocks of 4: 9 held, 1 free, fewer than the 3 running.
    s = create_scheduler(speculative=SPEC, block_size=4, num_blocks=10, policy="fcfs")
    reqs = [create_request(s, f"r{i}", [20 + i, 30 + i] * 4, max_tokens=20, ignore_eos=True) for i in range(3)]
    while any(r.num_output_tokens == 0 for r in reqs):
        run_step(s, lambda r: r.all_token_ids[-2])
    # one more token each (drafts rejected): 10 tokens in 3 blocks each
    out, _ = run_step(s, lambda r: r.all_token_ids[-2], accept_fn=lambda r, d: 0)
    assert all(len(r.blocks) == 3 for r in reqs) and s.pool.num_free_blocks == 1
    out = s.schedule()
    # 10 tokens in 3 blocks of 4: room for 2 drafts each; nobody takes the free block
    assert out.spec_tokens == {f"r{i}": [20 + i, 30 + i] for i in range(3)}
    assert s.pool.num_free_blocks == 1 and not out.preempted


def test_seeded_requests_do_not_speculate():
    import torch

    s = create_scheduler(speculative=SPEC)
    req = create_request(s, "a", [11, 12, 11, 12], max_tokens=10, add=False)
    req.generator = torch.Generator().manual_seed(1)
    s.add_request(req)
    _decoding(s, req, token=11)
    assert s.schedule().spec_tokens == {}


def test_preempting_a_speculating_request_withdraws_its_drafts():
    # a (high priority under fcfs) needs a block while b holds the rest: b is preempted.
    s = create_scheduler(speculative=SPEC, block_size=4, num_blocks=5, policy="fcfs")
    a = create_request(s, "a", [11, 12, 11, 12, 11, 12, 11], max_tokens=8, ignore_eos=True)
    b = create_request(s, "b", [13, 14, 13, 14, 13, 14, 13, 14, 13, 14, 13], max_tokens=8, ignore_eos=True)
    while a.num_output_tokens == 0 or b.num_output_tokens == 0:
        run_step(s, lambda r: r.all_token_ids[-2])
    for _ in range(20):
        out, _ = run_step(s, lambda r: r.all_token_ids[-2], accept_fn=lambda r, d: 0)
        for r in out.preempted:
            assert r.request_id not in out.spec_tokens
        if not s.has_unfinished():
            break
    drain(s, lambda r: r.all_token_ids[-2])
    assert_all_released(s)


def test_a_request_whose_drafts_fail_drafts_one_at_a_time():
    s = create_scheduler(speculative=SPEC)
    req = create_request(s, "a", [11, 12] * 8, max_tokens=100, ignore_eos=True)
    _decoding(s, req, token=11)
    sizes = []
    for _ in range(8):   # the model never agrees: each step yields a token that keeps the loop
        out = s.schedule()
        sizes.append(len(out.spec_tokens.get("a", [])))
        s.update_from_output(out, [[req.all_token_ids[-2]] if "a" in out.spec_tokens else req.all_token_ids[-2]])
    assert sizes[0] == 4 and sizes[-1] == 1, sizes
    for _ in range(12):  # now it agrees with every draft: back to 4
        out = s.schedule()
        d = out.spec_tokens.get("a", [])
        sizes.append(len(d))
        s.update_from_output(out, [[*d, req.all_token_ids[-2] if len(d) % 2 == 0 else req.all_token_ids[-1]]])
    assert sizes[-1] == 4, sizes


# --- adaptive draft length (scheduler.py, START_DRAFTS) ----------------------------------------------
ADAPTIVE = SpeculativeConfig(num_speculative_tokens=10, prompt_lookup_min=2, prompt_lookup_max=3)


def _verify(s, req, agree: bool) -> int:
    """One step of `req` decoding a period-2 loop; the model takes every draft (agree) or none.
    Returns how many drafts the step gave it."""
    out = s.schedule()
    d = out.spec_tokens.get(req.request_id, [])
    if agree:   # the drafts continue the loop, and so does the token sampled after them
        mine = [*d, req.all_token_ids[-2] if len(d) % 2 == 0 else req.all_token_ids[-1]]
    else:       # none taken (the sampled token still continues the loop, so drafts stay possible)
        mine = [req.all_token_ids[-2]]
    s.update_from_output(out, [mine if r is req else TOKEN for (r, _), smp in zip(out.scheduled, out.samples) if smp])
    return len(d)


def test_a_request_drafts_more_after_full_acceptance_and_less_after_a_rejection():
    assert ADAPTIVE.adaptive   # the default
    s = create_scheduler(speculative=ADAPTIVE)
    req = create_request(s, "a", [11, 12] * 8, max_tokens=200, ignore_eos=True)
    _decoding(s, req, token=11)
    grown = [_verify(s, req, agree=True) for _ in range(5)]
    assert grown == [6, 8, 10, 10, 10]          # from 6, +2 per verification that took every draft, up to 10
    shrunk = [_verify(s, req, agree=False) for _ in range(3)]
    assert shrunk == [10, 9, 8]                 # -1 after each that rejected one
    assert req.draft_len == 7
    s.check_invariants()


def test_a_draft_cut_short_by_the_budget_does_not_lengthen_the_next():
    s = create_scheduler(speculative=ADAPTIVE, max_num_batched_tokens=5)
    req = create_request(s, "a", [11, 12] * 8, max_tokens=200, ignore_eos=True)
    _decoding(s, req, token=11)
    assert [_verify(s, req, agree=True) for _ in range(3)] == [4, 4, 4]   # the budget leaves 4
    assert req.draft_len == 6                   # never given its whole length: not grown
    s.check_invariants()


def test_in_a_step_with_prompt_tokens_a_request_drafts_at_most_the_start_length():
    s = create_scheduler(speculative=ADAPTIVE, decode_yield_steps=0)
    req = create_request(s, "a", [11, 12] * 8, max_tokens=200, ignore_eos=True)
    _decoding(s, req, token=11)
    while req.draft_len is None or req.draft_len < 10:
        _verify(s, req, agree=True)
    create_request(s, "late", 40, max_tokens=4)
    assert _verify(s, req, agree=True) == 6     # beside the late call's prompt: 6, its length stays 10
    assert req.draft_len == 10
    assert _verify(s, req, agree=True) == 10    # decodes alone again
    s.check_invariants()


def test_without_adaptive_every_draft_has_the_configured_length():
    fixed = SpeculativeConfig(num_speculative_tokens=10, prompt_lookup_min=2, prompt_lookup_max=3, adaptive=False)
    s = create_scheduler(speculative=fixed, decode_yield_steps=0)
    req = create_request(s, "a", [11, 12] * 8, max_tokens=200, ignore_eos=True)
    _decoding(s, req, token=11)
    assert [_verify(s, req, agree=a) for a in (True, False, True)] == [10, 10, 10]
    create_request(s, "late", 40, max_tokens=4)
    assert _verify(s, req, agree=True) == 10    # beside a prompt too
    assert req.draft_len is None
    assert parse_speculative_config('{"adaptive": false}').adaptive is False
    with pytest.raises(ValueError):
        parse_speculative_config('{"adaptive": "yes"}')
