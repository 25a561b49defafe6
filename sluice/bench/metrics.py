"""The seed post's metrics, as pure functions of call and workflow records.

- Aggregate output throughput: output tokens of all calls (failed ones included: the server did
  generate them) / wall time from the first admission to the end of the drain.
- Per-request generation speed: (output tokens - 1) / (last token time - first token time),
  median over successful calls with at least two tokens.
- TTFT: request sent to the first chunk carrying generated text, over successful calls.
- Workflow end-to-end latency: admission to the end of its last call, over completed workflows.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

import numpy as np

from sluice.bench.client import CallRecord, CallStatus


@dataclass
class WorkflowRecord:
    """One admitted workflow. Times relative to the run's start, like CallRecord's."""

    index: int
    num_steps: int
    admit_time: float
    end_time: Optional[float] = None
    completed: bool = False            # every call succeeded
    calls: int = 0                     # calls sent (a failed call ends the workflow)

    @property
    def latency(self) -> Optional[float]:
        return None if self.end_time is None else self.end_time - self.admit_time

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "num_steps": self.num_steps,
            "admit_time": round(self.admit_time, 5),
            "end_time": None if self.end_time is None else round(self.end_time, 5),
            "completed": self.completed,
            "calls": self.calls,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorkflowRecord":
        return cls(**d)


@dataclass(frozen=True)
class Summary:
    """Every figure of one run. Token rates in tokens/s, times in seconds."""

    wall_time_s: float
    admitted_workflows: int
    completed_workflows: int
    failed_workflows: int
    total_calls: int
    ok_calls: int
    failed_calls: int
    output_tokens: int
    input_tokens: int                       # usage.prompt_tokens summed (0 where none reported)
    cached_tokens: Optional[int]            # None when the server reported none
    cached_fraction: Optional[float]        # cached / input tokens, over calls reporting both
    output_throughput: float
    generation_speed_p50: Optional[float]
    ttft_p50: Optional[float]
    ttft_p90: Optional[float]
    ttft_p99: Optional[float]
    call_latency_p50: Optional[float]
    workflow_latency_p50: Optional[float]
    workflow_latency_p90: Optional[float]
    errors: dict[str, int]                  # failed calls by kind ("http 503", "timeout", ...)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# (field, label, unit, higher is better); the order of the tables.
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("output_throughput", "Aggregate output throughput", "tok/s", True),
    ("generation_speed_p50", "Per-request generation speed (median)", "tok/s", True),
    ("ttft_p50", "TTFT p50", "s", False),
    ("ttft_p90", "TTFT p90", "s", False),
    ("ttft_p99", "TTFT p99", "s", False),
    ("completed_workflows", "Completed workflows", "", True),
    ("admitted_workflows", "Admitted workflows", "", True),
    ("total_calls", "Total calls", "", True),
    ("failed_calls", "Failed calls", "", False),
    ("output_tokens", "Output tokens", "", True),
    ("input_tokens", "Input tokens (server-reported)", "", True),
    ("cached_tokens", "Cached prompt tokens (server-reported)", "", True),
    ("cached_fraction", "Cached fraction of input", "", True),
    ("workflow_latency_p50", "Workflow end-to-end latency p50", "s", False),
    ("workflow_latency_p90", "Workflow end-to-end latency p90", "s", False),
    ("call_latency_p50", "Call latency p50", "s", False),
    ("wall_time_s", "Wall time", "s", False),
)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# Two-sided 95% quantiles of Student's t for 1-10 degrees of freedom; beyond, the Cornish-Fisher
# expansion around the normal quantile (within 0.003 of the exact value from 11 on).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("need at least one degree of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def ratio_interval(ratios: Sequence[Optional[float]]) -> Optional[tuple[float, float, float]]:
    """(geometric mean, low, high): a 95% confidence interval of the ratio A/B from the ratios
    of paired runs, by a t interval on their logarithms (ratios multiply, so they are averaged
    on the log scale). None with fewer than two positive ratios."""
    logs = [math.log(r) for r in ratios if r is not None and r > 0 and math.isfinite(r)]
    if len(logs) < 2:
        return None
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = t975(len(logs) - 1) * sd / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def error_kind(call: CallRecord) -> str:
    """"http 503", "timeout", "connection", ...: how failures are counted."""
    return f"http {call.http_status}" if call.status is CallStatus.HTTP else call.status.value


def summarize(calls: Sequence[CallRecord], workflows: Sequence[WorkflowRecord], wall_time_s: float) -> Summary:
    ok = [c for c in calls if c.ok]
    ttfts = [t for c in ok if (t := c.ttft) is not None]
    speeds = [s for c in ok if (s := c.generation_speed) is not None]
    latencies = [t for c in ok if (t := c.latency) is not None]
    wf_latencies = [t for w in workflows if w.completed and (t := w.latency) is not None]
    output_tokens = sum(c.output_tokens for c in calls)
    reported = [c for c in calls if c.prompt_tokens is not None]
    with_cache = [c for c in reported if c.cached_tokens is not None]
    cached = sum(c.cached_tokens or 0 for c in with_cache) if with_cache else None
    cached_input = sum(c.prompt_tokens or 0 for c in with_cache)
    completed = sum(1 for w in workflows if w.completed)
    return Summary(
        wall_time_s=wall_time_s,
        admitted_workflows=len(workflows),
        completed_workflows=completed,
        failed_workflows=len(workflows) - completed,
        total_calls=len(calls),
        ok_calls=len(ok),
        failed_calls=len(calls) - len(ok),
        output_tokens=output_tokens,
        input_tokens=sum(c.prompt_tokens or 0 for c in reported),
        cached_tokens=cached,
        cached_fraction=(cached / cached_input) if cached is not None and cached_input else None,
        output_throughput=output_tokens / wall_time_s if wall_time_s > 0 else 0.0,
        generation_speed_p50=percentile(speeds, 50),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        call_latency_p50=percentile(latencies, 50),
        workflow_latency_p50=percentile(wf_latencies, 50),
        workflow_latency_p90=percentile(wf_latencies, 90),
        errors=dict(sorted(Counter(error_kind(c) for c in calls if not c.ok).items())),
    )


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation of one figure over repeats (n counts runs that had it)."""

    mean: Optional[float]
    std: Optional[float]
    n: int

    def to_json(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n}


def aggregate(summaries: Sequence[Summary]) -> dict[str, Stat]:
    """Mean and standard deviation (ddof=1; 0 for a single run) of every numeric figure."""
    out: dict[str, Stat] = {}
    for f in fields(Summary):
        if f.name == "errors":
            continue
        vals = [float(v) for s in summaries if (v := getattr(s, f.name)) is not None]
        if not vals:
            out[f.name] = Stat(None, None, 0)
            continue
        std = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
        out[f.name] = Stat(float(np.mean(vals)), std, len(vals))
    return out


def aggregate_errors(summaries: Sequence[Summary]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for s in summaries:
        total.update(s.errors)
    return dict(sorted(total.items()))


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """A/B; None when either is missing or B is zero."""
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def throughput_series(calls: Sequence[CallRecord], wall_time_s: float, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of `bin_s` seconds: (bin start times, rates). Each call's tokens are
    spread over its chunks (usage counts tokens, a chunk may carry several)."""
    n_bins = max(1, math.ceil(wall_time_s / bin_s))
    counts = np.zeros(n_bins, dtype=np.float64)
    for c in calls:
        if not c.chunk_times:
            continue
        per_chunk = c.output_tokens / len(c.chunk_times)
        idx = np.clip((np.asarray(c.chunk_times) / bin_s).astype(np.int64), 0, n_bins - 1)
        np.add.at(counts, idx, per_chunk)
    starts = [i * bin_s for i in range(n_bins)]
    return starts, (counts / bin_s).tolist()
