"""`sluice bench floor`: the ideal single-server schedules on hand-built jobs, the prompt cost, and
the command on a results.json written the way `sluice bench` writes it."""
from __future__ import annotations

import random

import pytest

import sluice.bench.cli as cli
from sluice.bench.client import CallRecord, CallStatus
from sluice.bench.floor import (SMOLLM2_ATTN_FLOP_PER_CONTEXT, SMOLLM2_LINEAR_FLOP, PromptCost,
                                fcfs_response_times, floor_rows, poisson_jobs, srpt_response_times)
from sluice.bench.metrics import WorkflowRecord, summarize
from sluice.bench.report import write_results
from sluice.bench.run import RunResult, ScenarioSpec
from sluice.bench.workload import WorkloadConfig


def test_fcfs_by_hand():
    # The second job waits for the first; the third finds the server idle. Input order is kept.
    assert fcfs_response_times([(0.5, 1.0), (0.0, 1.0), (3.0, 0.5)]) == pytest.approx([1.5, 1.0, 0.5])


def test_srpt_preempts_for_a_shorter_job():
    # At t=1 the long job has 3 left; the new 1-unit job runs first and ends at 2, the long one at 5.
    assert srpt_response_times([(0.0, 4.0), (1.0, 1.0)]) == pytest.approx([5.0, 1.0])
    # Not preempted by a job longer than what it has left.
    assert srpt_response_times([(0.0, 2.0), (1.0, 3.0)]) == pytest.approx([2.0, 4.0])
    # Equal work arriving together: the earlier in arrival order (then input order) first.
    assert srpt_response_times([(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([1.0, 2.0])
    # An idle gap, then a burst served shortest first.
    assert srpt_response_times([(10.0, 3.0), (10.0, 1.0), (10.0, 2.0)]) == pytest.approx([6.0, 1.0, 3.0])


@pytest.mark.parametrize("seed", range(5))
def test_srpt_against_fcfs_on_random_jobs(seed):
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for _ in range(300):
        t += rng.expovariate(2.0)
        jobs.append((t, rng.lognormvariate(-1.5, 0.6)))
    f, s = fcfs_response_times(jobs), srpt_response_times(jobs)
    # Both are work-conserving: the server ends at the same time.
    assert max(a + r for (a, _), r in zip(jobs, f)) == pytest.approx(max(a + r for (a, _), r in zip(jobs, s)))
    # No job finishes before its own work is done, and SRPT's mean is the smaller (it is optimal).
    for (_, w), rf, rs in zip(jobs, f, s):
        assert rf >= w - 1e-12 and rs >= w - 1e-12
    assert sum(s) <= sum(f) + 1e-9


def test_poisson_jobs_keep_the_work_and_the_rate():
    jobs = [(5.0 + 0.01 * i, 0.001 * i) for i in range(2001)]   # 20 s of sends, 100 a second
    drawn = poisson_jobs(jobs, seed=3)
    assert sorted(w for _, w in drawn) == sorted(w for _, w in jobs)
    assert [w for _, w in drawn] != [w for _, w in jobs]          # shuffled
    arrivals = [a for a, _ in drawn]
    assert arrivals[0] == 5.0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.01, rel=0.1)
    # Exponential gaps: their standard deviation is their mean (evenly spaced sends have none).
    mean = sum(gaps) / len(gaps)
    sd = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert sd == pytest.approx(mean, rel=0.15)
    assert poisson_jobs(jobs, seed=3) == drawn and poisson_jobs(jobs, seed=4) != drawn
    assert poisson_jobs(jobs[:1], seed=0) == jobs[:1]


def test_prompt_cost():
    cost = PromptCost(linear_rate=1e9, attn_rate=2e9)
    assert cost.seconds(0, 500) == 0.0
    # 10 new tokens after 100 cached attend to 105.5 positions on average.
    want = 10 * (SMOLLM2_LINEAR_FLOP / 1e9 + SMOLLM2_ATTN_FLOP_PER_CONTEXT * 105.5 / 2e9)
    assert cost.seconds(10, 100) == pytest.approx(want)
    # SmolLM2-135M: ~212 MFLOP of projections a token, 69,120 FLOP per token of context.
    assert SMOLLM2_LINEAR_FLOP == 212_336_640 and SMOLLM2_ATTN_FLOP_PER_CONTEXT == 69_120


def _results(tmp_path):
    """Two calls sent together, 1,000 and 100 uncached tokens, and a failed one."""
    def call(i, send, prompt, cached, ttft, status=CallStatus.OK):
        return CallRecord(workflow_index=i, step_index=0, max_tokens=10, send_time=send,
                          first_token_time=send + ttft if status is CallStatus.OK else None,
                          last_token_time=send + 1.0, end_time=send + 1.0, num_chunks=10, output_tokens=10,
                          output_tokens_from_usage=True, prompt_tokens=prompt, cached_tokens=cached, status=status,
                          http_status=200 if status is CallStatus.OK else 500)
    calls = [call(0, 0.0, 1000, 0, 2.0), call(1, 0.0, 600, 500, 0.5),
             call(2, 1.0, 50, 0, 0.0, status=CallStatus.HTTP)]
    workflows = [WorkflowRecord(i, 1, admit_time=0.0, end_time=2.0, completed=i < 2, calls=1) for i in range(3)]
    run = RunResult(repeat=0, seed=0, run_id="s0", started_at="t", wall_time_s=2.0, calls=calls,
                    workflows=workflows, summary=summarize(calls, workflows, wall_time_s=2.0))
    files = write_results(tmp_path / "r", "engine", [run], ScenarioSpec(kind="sustained", window_s=1.0),
                          WorkloadConfig(), {}, ["sluice", "bench"])
    return files["json"]


def test_floor_rows_from_a_results_file(tmp_path):
    path = _results(tmp_path)
    cost = PromptCost(linear_rate=1e11, attn_rate=1e11)
    (row,) = floor_rows(path, cost)
    assert row.label == "engine" and row.calls == 2    # the failed call is left out
    long, short = cost.seconds(1000, 0), cost.seconds(100, 500)
    assert row.own == (pytest.approx((long + short) / 2), pytest.approx(short + 0.9 * (long - short)))
    # SRPT: the short prompt first, the long one after it; FCFS: in input order (the long one first).
    assert row.srpt == (pytest.approx((short + short + long) / 2), pytest.approx(short + 0.9 * long))
    assert row.fcfs == (pytest.approx((long + long + short) / 2), pytest.approx(long + 0.9 * short))
    assert row.measured == (pytest.approx(1.25), pytest.approx(1.85))
    assert row.srpt_poisson_p90 is None
    # Both were sent at once: no span to take a rate from, so the Poisson replay is the recorded one.
    (row,) = floor_rows(path, cost, poisson=3)
    assert row.srpt_poisson_p90 == (pytest.approx(row.srpt[1]), pytest.approx(row.srpt[1]))


def test_floor_command(tmp_path, capsys):
    path = _results(tmp_path)
    assert cli.main(["floor", str(path), "--linear-gflops", "433"]) == 0
    out = capsys.readouterr().out
    assert "433 GFLOP/s" in out and "| engine #0 | 2 |" in out and "Poisson" not in out
    assert cli.main(["floor", str(path), "--poisson", "2"]) == 0
    assert "Poisson arrivals" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="must be positive"):
        cli.main(["floor", str(path), "--attn-gflops", "0"])
    with pytest.raises(SystemExit, match="not a"):
        (tmp_path / "x.json").write_text("{}")
        cli.main(["floor", str(tmp_path / "x.json")])
