"""vLLM's `repetition_detection` (an output stuck in a loop ends with finish reason "repetition")
and the stream interval's rule for when a request's outputs go out, on hand-built inputs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.engine.request import Request, RequestStatus
from sluice.outputs import CompletionOutput, RequestOutput
from sluice.sampling_params import RepetitionDetectionParams, SamplingParams
from sluice.server.serving_messages import stop_reason as anthropic_stop_reason
from sched_utils import (
    EOS, TOKEN, assert_all_released, create_request, create_scheduler, drain, run_step, unique_prompt,
)


def reference_repeats(tokens: list[int], max_size: int, min_size: int, count: int) -> bool:
    """The rule as stated, compared segment by segment: some pattern length L in
    [max(1, min_size), max_size] whose last `count` segments of L tokens are all equal."""
    if max_size <= 0 or count < 2:
        return False
    n = len(tokens)
    for size in range(max(1, min_size), max_size + 1):
        if size * count > n:
            return False
        segments = [tokens[n - (k + 1) * size:n - k * size] for k in range(count)]
        if all(seg == segments[0] for seg in segments):
            return True
    return False


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40), max_size=st.integers(1, 12),
       min_size=st.integers(0, 12), count=st.integers(2, 5))
def test_repeats_matches_the_rule_segment_by_segment(tokens, max_size, min_size, count):
    min_size = min(min_size, max_size)
    params = RepetitionDetectionParams(max_pattern_size=max_size, min_pattern_size=min_size, min_count=count)
    assert params.repeats(tokens) == reference_repeats(tokens, max_size, min_size, count)


@settings(max_examples=200, deadline=None)
@given(pattern=st.lists(st.integers(0, 50), min_size=1, max_size=6), head=st.lists(st.integers(0, 50), max_size=10),
       count=st.integers(2, 4))
def test_a_pattern_repeated_count_times_is_found_and_one_fewer_is_not_necessarily(pattern, head, count):
    params = RepetitionDetectionParams(max_pattern_size=len(pattern), min_count=count)
    assert params.repeats(head + pattern * count)
    assert params.repeats(head + pattern * (count - 1)) == reference_repeats(
        head + pattern * (count - 1), len(pattern), 0, count)


def test_repeats_examples():
    abc = [1, 2, 3]
    assert RepetitionDetectionParams(max_pattern_size=3, min_count=3).repeats([9] + abc * 3)
    assert not RepetitionDetectionParams(max_pattern_size=3, min_count=4).repeats([9] + abc * 3)
    assert not RepetitionDetectionParams(max_pattern_size=2, min_count=3).repeats(abc * 3)     # too short a pattern
    assert not RepetitionDetectionParams(max_pattern_size=8, min_pattern_size=4, min_count=2).repeats(abc * 2)
    # "abcabc" is also a pattern of 6 twice: found at size 6 with count 2 once it is there twice
    assert RepetitionDetectionParams(max_pattern_size=6, min_pattern_size=4, min_count=2).repeats(abc * 4)
    assert RepetitionDetectionParams(max_pattern_size=1, min_count=2).repeats([4, 7, 7])
    assert not RepetitionDetectionParams(max_pattern_size=1, min_count=2).repeats([7, 4, 7])
    assert not RepetitionDetectionParams(max_pattern_size=0).repeats([7] * 10)                 # off
    assert not RepetitionDetectionParams(max_pattern_size=1000, min_count=2).repeats([7])


@pytest.mark.parametrize("kwargs, message", [
    ({"max_pattern_size": 4, "min_count": 1}, "min_count must be at least 2"),
    ({"max_pattern_size": 4, "min_count": 0}, "min_count must be at least 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": -1, "min_count": 2}, "must be >= 0"),
    ({"max_pattern_size": True, "min_count": 2}, "must be an integer"),
    ({"max_pattern_size": 2.0, "min_count": 2}, "must be an integer"),
])
def test_invalid_repetition_detection(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RepetitionDetectionParams(**kwargs)
    with pytest.raises(ValueError, match=message):
        SamplingParams(repetition_detection=kwargs)     # the offline API takes the dict too


def test_disabled_detection_needs_no_count():
    assert not RepetitionDetectionParams().enabled
    assert SamplingParams(repetition_detection={"max_pattern_size": 0}).repetition_detection.enabled is False


def _request(max_tokens=20, min_tokens=0, **detect) -> Request:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            repetition_detection=RepetitionDetectionParams(**detect))
    return Request("r", [100, 101], params, max_tokens, 0.0, eos_token_ids=(EOS,))


def _feed(req: Request, tokens: list[int]) -> list:
    statuses = []
    for t in tokens:
        req.append_output_token(t)
        statuses.append(req.check_stop(max_model_len=1000))
    return statuses


def test_check_stop_ends_on_the_token_that_completes_the_repetition():
    req = _request(max_pattern_size=2, min_count=3)
    statuses = _feed(req, [5, 6, 5, 6, 5, 6])
    assert statuses == [None] * 5 + [RequestStatus.FINISHED_REPETITION]
    assert req.stop_reason == "repetition_detected"
    assert RequestStatus.FINISHED_REPETITION.finished and RequestStatus.FINISHED_REPETITION.completed


def test_min_tokens_holds_repetition_back_and_length_comes_first():
    req = _request(min_tokens=5, max_pattern_size=1, min_count=2)
    assert _feed(req, [7, 7, 7, 7, 7]) == [None] * 4 + [RequestStatus.FINISHED_REPETITION]
    req = _request(max_tokens=3, max_pattern_size=1, min_count=3)
    assert _feed(req, [7, 7, 7]) == [None, None, RequestStatus.FINISHED_LENGTH]   # vLLM's order
    req = _request(max_pattern_size=1, min_count=2)
    assert _feed(req, [7, EOS]) == [None, RequestStatus.FINISHED_STOPPED]


def test_a_call_ended_by_repetition_retains_its_kv_for_the_workflow():
    """Repetition is the output's own end, as a stop is: the call's KV is retained for its
    workflow's next call; every block is accounted for after the drain."""
    s = create_scheduler(block_size=16, num_blocks=20)
    call = create_request(s, "c1", 40, max_tokens=30, workflow_id="agent",
                          repetition_detection=RepetitionDetectionParams(max_pattern_size=1, min_count=4))
    drain(s)     # every sampled token is TOKEN: the fourth ends the call
    assert call.status is RequestStatus.FINISHED_REPETITION and call.output_token_ids == [TOKEN] * 4
    assert s.workflows.workflows["agent"].retention is not None and s.workflows.num_retained_blocks > 0
    assert_all_released(s)


def test_repetition_inside_an_accepted_run_of_drafts():
    """With speculative decoding the check runs per accepted token: the call ends at the token
    that completed the repetition, and the drafts after it are not kept."""
    from sluice.config import SpeculativeConfig

    s = create_scheduler(speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                                       prompt_lookup_max=2))
    prompt = unique_prompt(20)
    # The prompt repeats its tail, so drafts come from it; the model "accepts" them all.
    prompt = prompt + [TOKEN] * 3 + prompt[:3] + [TOKEN] * 3
    call = create_request(s, "c1", prompt, max_tokens=40,
                          repetition_detection=RepetitionDetectionParams(max_pattern_size=1, min_count=5))
    steps = 0
    while s.has_unfinished():
        out, _ = run_step(s)
        steps += 1
        assert steps < 100
    assert s.spec_accepted_tokens_total > 0, "no drafts were verified: the test tests nothing"
    assert call.status is RequestStatus.FINISHED_REPETITION
    assert call.output_token_ids == [TOKEN] * 5
    assert call.num_computed_tokens <= call.num_tokens
    assert_all_released(s)


def test_anthropic_stop_reason_of_a_repetition_is_end_turn():
    sample = CompletionOutput(index=0, text="", token_ids=[1], finish_reason="repetition",
                              stop_reason="repetition_detected")
    assert anthropic_stop_reason(sample, called=False) == ("end_turn", None)
    sample = CompletionOutput(index=0, text="", token_ids=[1], finish_reason="stop", stop_reason="###")
    assert anthropic_stop_reason(sample, called=False) == ("stop_sequence", "###")


def test_inter_token_latency_counts_every_step_of_a_coalesced_output():
    """The server's latency histograms: one inter-token gap per engine step that made tokens,
    also when one output carries several steps' tokens."""
    from sluice.engine.stats import EngineStats
    from sluice.server.metrics import ServerMetrics

    metrics = ServerMetrics(lambda: EngineStats(), "m")
    recorder = metrics.recorder(arrival=0.0)

    def output(times, finished=False):
        return RequestOutput("r", [1], [CompletionOutput(0, "", [], num_new_tokens=len(times),
                                                         finish_reason="stop" if finished else None)],
                             finished, token_times=times)

    recorder.observe(output([10.0]))
    recorder.observe(output([10.5, 11.0, 11.25]))
    recorder.observe(output([12.0], finished=True))
    itl = metrics.inter_token_latency
    assert itl._sum.get() == pytest.approx(2.0)       # 0.5 + 0.5 + 0.25 + 0.75
    assert sum(b.get() for b in itl._buckets) == 4
    assert sum(b.get() for b in metrics.time_to_first_token._buckets) == 1
