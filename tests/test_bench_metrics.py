"""Metric arithmetic on hand-made call and workflow records."""
from __future__ import annotations

import math

import pytest

from sluice.bench.client import CallRecord, CallStatus
from sluice.bench.metrics import (
    WorkflowRecord,
    aggregate,
    ratio,
    ratio_interval,
    summarize,
    t975,
    throughput_series,
)


def call(
    wf: int, step: int, send: float, first: float | None, last: float | None, tokens: int, *,
    end: float | None = None, status: CallStatus = CallStatus.OK, http: int | None = 200,
    prompt: int | None = None, cached: int | None = None, chunks: list[float] | None = None,
) -> CallRecord:
    return CallRecord(
        workflow_index=wf, step_index=step, max_tokens=tokens, send_time=send,
        first_token_time=first, last_token_time=last, end_time=end if end is not None else last,
        num_chunks=len(chunks) if chunks else tokens, output_tokens=tokens,
        output_tokens_from_usage=True, prompt_tokens=prompt, cached_tokens=cached,
        status=status, http_status=http, chunk_times=chunks or [],
    )


def test_per_call_derived_figures():
    c = call(0, 0, send=1.0, first=1.5, last=3.5, tokens=11, end=3.6)
    assert c.ttft == pytest.approx(0.5)
    assert c.generation_speed == pytest.approx(10 / 2.0)   # (11 - 1) / (3.5 - 1.5)
    assert c.latency == pytest.approx(2.6)
    assert call(0, 0, 0.0, 1.0, 1.0, 1).generation_speed is None   # one token: undefined
    assert call(0, 0, 0.0, None, None, 0, end=5.0, status=CallStatus.TIMEOUT).ttft is None


def _records():
    calls = [
        # workflow 0: two good calls
        call(0, 0, 0.0, 1.0, 3.0, 21, prompt=100, cached=0),     # ttft 1, speed 10
        call(0, 1, 4.0, 6.0, 8.0, 41, prompt=200, cached=96),    # ttft 2, speed 20
        # workflow 1: one good call, then HTTP 503
        call(1, 0, 0.0, 3.0, 4.0, 11, prompt=100, cached=64),    # ttft 3, speed 10
        call(1, 1, 5.0, None, None, 0, end=5.1, status=CallStatus.HTTP, http=503),
        # workflow 2: a timeout after 5 streamed tokens (they count toward throughput)
        call(2, 0, 0.0, 4.0, 4.4, 5, end=9.0, status=CallStatus.TIMEOUT, prompt=None),
    ]
    workflows = [
        WorkflowRecord(0, 2, admit_time=0.0, end_time=8.0, completed=True, calls=2),
        WorkflowRecord(1, 3, admit_time=0.0, end_time=5.1, completed=False, calls=2),
        WorkflowRecord(2, 2, admit_time=0.0, end_time=9.0, completed=False, calls=1),
    ]
    return calls, workflows


def test_summary_arithmetic():
    calls, workflows = _records()
    s = summarize(calls, workflows, wall_time_s=10.0)
    assert (s.admitted_workflows, s.completed_workflows, s.failed_workflows) == (3, 1, 2)
    assert (s.total_calls, s.ok_calls, s.failed_calls) == (5, 3, 2)
    assert s.output_tokens == 21 + 41 + 11 + 0 + 5
    assert s.output_throughput == pytest.approx(78 / 10.0)
    assert s.generation_speed_p50 == pytest.approx(10.0)            # median of 10, 20, 10
    assert s.ttft_p50 == pytest.approx(2.0)                          # ok calls: 1, 2, 3
    assert s.ttft_p90 == pytest.approx(2.8)                          # linear interpolation
    assert s.ttft_p99 == pytest.approx(2.98)
    assert s.input_tokens == 400
    assert s.cached_tokens == 160
    assert s.cached_fraction == pytest.approx(160 / 400)
    assert s.workflow_latency_p50 == pytest.approx(8.0)              # completed workflows only
    assert s.errors == {"http 503": 1, "timeout": 1}


def test_call_latency_median_is_over_successful_calls():
    calls, workflows = _records()
    latencies = sorted(c.latency for c in calls if c.ok)
    assert latencies == pytest.approx([3.0, 4.0, 4.0])
    assert summarize(calls, workflows, 10.0).call_latency_p50 == pytest.approx(4.0)


def test_no_cache_reports_is_none_not_zero():
    calls = [call(0, 0, 0.0, 1.0, 2.0, 3, prompt=50, cached=None)]
    s = summarize(calls, [WorkflowRecord(0, 1, 0.0, 2.0, True, 1)], 2.0)
    assert s.cached_tokens is None and s.cached_fraction is None
    assert s.input_tokens == 50


def test_empty_run():
    s = summarize([], [], 0.0)
    assert s.output_throughput == 0.0
    assert s.ttft_p50 is None and s.generation_speed_p50 is None
    assert s.errors == {}


def test_aggregate_mean_and_sample_std():
    calls, workflows = _records()
    a = summarize(calls, workflows, 10.0)
    b = summarize(calls, workflows, 5.0)          # twice the throughput
    stats = aggregate([a, b])
    t = stats["output_throughput"]
    assert t.mean == pytest.approx((7.8 + 15.6) / 2)
    assert t.std == pytest.approx(math.sqrt(((7.8 - 11.7) ** 2 + (15.6 - 11.7) ** 2) / 1))
    assert t.n == 2
    assert aggregate([a])["output_throughput"].std == 0.0
    empty = aggregate([summarize([], [], 1.0)])["ttft_p50"]
    assert empty.mean is None and empty.n == 0


def test_ratio():
    assert ratio(6.0, 3.0) == pytest.approx(2.0)
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 1.0) is None


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(10) == 2.228
    for df, exact in ((11, 2.201), (15, 2.131), (20, 2.086), (30, 2.042), (120, 1.980)):
        assert t975(df) == pytest.approx(exact, abs=0.003)
    with pytest.raises(ValueError):
        t975(0)


def test_ratio_interval_is_a_t_interval_on_log_ratios():
    gm, lo, hi = ratio_interval([math.exp(0.1), math.exp(-0.1)])
    half = 12.706 * math.sqrt(0.02) / math.sqrt(2)          # sd of (0.1, -0.1) is sqrt(0.02)
    assert (gm, lo, hi) == pytest.approx((1.0, math.exp(-half), math.exp(half)))
    assert ratio_interval([2.0, 2.0, 2.0]) == pytest.approx((2.0, 2.0, 2.0))
    # more pairs with the same spread: a narrower interval around the same geometric mean
    few = ratio_interval([1.8, 2.2])
    many = ratio_interval([1.8, 2.2] * 4)
    assert few[0] == pytest.approx(many[0]) and few[1] < many[1] < many[2] < few[2]
    assert ratio_interval([2.0]) is None and ratio_interval([2.0, None]) is None
    assert ratio_interval([2.0, None, 2.0]) == pytest.approx((2.0, 2.0, 2.0))


def test_throughput_series_spreads_usage_over_chunks():
    # 4 chunks carrying 8 tokens (usage) -> 2 tokens per chunk
    c = call(0, 0, 0.0, 0.2, 2.5, 8, chunks=[0.2, 0.7, 1.1, 2.5])
    starts, rates = throughput_series([c], wall_time_s=3.0, bin_s=1.0)
    assert starts == [0.0, 1.0, 2.0]
    assert rates == pytest.approx([4.0, 2.0, 2.0])
    assert sum(rates) * 1.0 == pytest.approx(c.output_tokens)
