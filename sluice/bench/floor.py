"""What time to first token an ideal engine would give the calls of a recorded run.

Every call's first token waits for its prompt's uncached tokens to be computed, and on one machine
those computations share the cores. `sluice bench floor RESULTS.json` replays a run's calls, at
the times they were sent and with the uncached tokens the server reported, through an idealised
engine: one server that computes prompt tokens at a given FLOP rate (by default this host type's
bf16 peak, faster than any kernel reaches) and spends nothing at all on decoding, scheduling or
HTTP. Two orders are replayed: first come first served, and preemptive shortest remaining prompt
first (SRPT: the order that minimises the mean response time of a single server). What those give
for TTFT p50 / p90 is what scheduling can reach at that run's load, on that machine: a run whose
measured TTFT sits near them has nothing left to win by order, and a TTFT target below them needs
less prompt work per call or faster arithmetic, not a scheduler.

Caveats: arrivals are the recorded ones (a closed loop sends a workflow's next call when its last
one ends, so an engine that finished calls in another order would see other arrival times; the
call rate is set by the run's throughput; `--poisson N` also replays the same calls' work in a
random order at Poisson arrivals of the same rate, N draws, for a reading that does not hang on
the recorded burstiness), and SRPT minimises the mean, not the 90th percentile, so it is an
ideal schedule, not a proof that no order could do better at p90.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from sluice.bench.metrics import percentile
from sluice.bench.report import load_results

# SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads of 64, 3 KV heads, intermediate 1536):
# multiply-adds x 2 per prompt token in the layers' projections (q, k, v, o, gate, up, down), and
# per token of context attended (scores and values, every head of every layer).
SMOLLM2_LINEAR_FLOP = 30 * 2 * (576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536 + 1536 * 576)
SMOLLM2_ATTN_FLOP_PER_CONTEXT = 30 * 2 * 2 * 9 * 64


@dataclass(frozen=True)
class PromptCost:
    """Seconds to compute `new` prompt tokens after `cached` ones, at FLOP rates (FLOP/s)."""
    linear_flop_per_token: float = SMOLLM2_LINEAR_FLOP
    attn_flop_per_context_token: float = SMOLLM2_ATTN_FLOP_PER_CONTEXT
    linear_rate: float = 470e9
    attn_rate: float = 470e9

    def seconds(self, new: int, cached: int) -> float:
        if new <= 0:
            return 0.0
        # Token i of the chunk attends to cached + i + 1 positions: cached + (new + 1) / 2 on average.
        context = cached + (new + 1) / 2
        return new * (self.linear_flop_per_token / self.linear_rate
                      + self.attn_flop_per_context_token * context / self.attn_rate)


def fcfs_response_times(jobs: Sequence[tuple[float, float]]) -> list[float]:
    """One server, first come first served, jobs (arrival, work) -> response times, in input order
    (ties in arrival keep input order)."""
    out = [0.0] * len(jobs)
    t = 0.0
    for i in sorted(range(len(jobs)), key=lambda i: jobs[i][0]):
        arrival, work = jobs[i]
        t = max(t, arrival) + work
        out[i] = t - arrival
    return out


def srpt_response_times(jobs: Sequence[tuple[float, float]]) -> list[float]:
    """One server, preemptive shortest remaining processing time first: jobs (arrival, work) ->
    response times, in input order. Ties go to the earlier arrival."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    out = [0.0] * len(jobs)
    heap: list[tuple[float, float, int]] = []   # (remaining work, arrival, index)
    t, k = 0.0, 0
    while k < len(order) or heap:
        if not heap:
            t = max(t, jobs[order[k]][0])
        while k < len(order) and jobs[order[k]][0] <= t:
            i = order[k]
            heapq.heappush(heap, (jobs[i][1], jobs[i][0], i))
            k += 1
        remaining, arrival, i = heap[0]
        next_arrival = jobs[order[k]][0] if k < len(order) else float("inf")
        if t + remaining <= next_arrival:
            heapq.heappop(heap)
            t += remaining
            out[i] = t - arrival
        else:
            # Run it until the next arrival, which may preempt it.
            heapq.heapreplace(heap, (remaining - (next_arrival - t), arrival, i))
            t = next_arrival
    return out


def _span(jobs: Sequence[tuple[float, float]]) -> float:
    """Seconds from the first arrival to the last (0 for fewer than two jobs)."""
    return max(a for a, _ in jobs) - min(a for a, _ in jobs) if jobs else 0.0


def poisson_jobs(jobs: Sequence[tuple[float, float]], seed: int) -> list[tuple[float, float]]:
    """The same works in a random order, arriving as a Poisson stream at the jobs' mean rate (their
    count over the span of their arrivals), starting at the first arrival."""
    span = _span(jobs)
    if span <= 0:
        return list(jobs)
    rng = random.Random(seed)
    works = [w for _, w in jobs]
    rng.shuffle(works)
    rate = (len(jobs) - 1) / span
    t, out = min(a for a, _ in jobs), []
    for w in works:
        out.append((t, w))
        t += rng.expovariate(rate)
    return out


@dataclass
class FloorRow:
    label: str
    repeat: int
    calls: int
    output_tok_s: float
    prompt_busy: float                 # the ideal engine's busy share of the window of sends
    measured: tuple[Optional[float], Optional[float]]      # TTFT p50, p90 as measured
    own: tuple[Optional[float], Optional[float]]           # each call's prompt alone
    fcfs: tuple[Optional[float], Optional[float]]
    srpt: tuple[Optional[float], Optional[float]]
    # SRPT's p90 over `poisson` draws of Poisson arrivals (min, max); None without them.
    srpt_poisson_p90: Optional[tuple[float, float]] = None


def _p50_p90(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    return percentile(values, 50), percentile(values, 90)


def floor_rows(path: Path, cost: PromptCost, poisson: int = 0) -> list[FloorRow]:
    """One row per run of a results.json: its successful calls' measured TTFT beside the ideal
    engine's, as p50 / p90. Calls without a server-reported prompt length are left out. With
    `poisson` > 0, also SRPT's p90 range over that many Poisson-arrival draws (seeds 0, 1, ...)."""
    label, runs, _ = load_results(path)
    rows = []
    for run in runs:
        calls = [c for c in run.calls if c.ok and c.first_token_time is not None and c.prompt_tokens is not None]
        jobs = [(c.send_time, cost.seconds(c.prompt_tokens - (c.cached_tokens or 0), c.cached_tokens or 0))
                for c in calls]
        span = _span(jobs)
        poisson_p90 = None
        if poisson > 0 and len(jobs) >= 2:
            p90s = [percentile(srpt_response_times(poisson_jobs(jobs, seed)), 90) for seed in range(poisson)]
            poisson_p90 = (min(p90s), max(p90s))
        rows.append(FloorRow(
            label=label, repeat=run.repeat, calls=len(calls),
            output_tok_s=run.summary.output_throughput,
            prompt_busy=sum(w for _, w in jobs) / span if span > 0 else 0.0,
            measured=_p50_p90([c.first_token_time - c.send_time for c in calls]),
            own=_p50_p90([w for _, w in jobs]),
            fcfs=_p50_p90(fcfs_response_times(jobs)),
            srpt=_p50_p90(srpt_response_times(jobs)),
            srpt_poisson_p90=poisson_p90,
        ))
    return rows


def floor_table(rows: Sequence[FloorRow], cost: PromptCost) -> str:
    def pair(p: tuple[Optional[float], Optional[float]]) -> str:
        return " / ".join("n/a" if v is None else f"{v:.3f}" for v in p)

    poisson = any(r.srpt_poisson_p90 is not None for r in rows)
    lines = [
        f"Ideal engine: prompt tokens at {cost.linear_rate / 1e9:.0f} GFLOP/s (projections, "
        f"{cost.linear_flop_per_token / 1e6:.1f} MFLOP a token) and {cost.attn_rate / 1e9:.0f} GFLOP/s "
        f"(attention, {cost.attn_flop_per_context_token / 1e3:.2f} kFLOP per token of context); "
        "decodes, scheduling and HTTP free. TTFT p50 / p90 in seconds.",
        "",
        "| run | calls | output tok/s | ideal prompt busy share | measured | own prompt alone | ideal FCFS | ideal SRPT |"
        + (" ideal SRPT p90, Poisson arrivals (min-max) |" if poisson else ""),
        "|---|---:|---:|---:|---|---|---|---|" + ("---|" if poisson else ""),
    ]
    for r in rows:
        line = (f"| {r.label} #{r.repeat} | {r.calls} | {r.output_tok_s:.1f} | {r.prompt_busy:.2f} | "
                f"{pair(r.measured)} | {pair(r.own)} | {pair(r.fcfs)} | {pair(r.srpt)} |")
        if poisson:
            q = r.srpt_poisson_p90
            line += " n/a |" if q is None else f" {q[0]:.3f}-{q[1]:.3f} |"
        lines.append(line)
    return "\n".join(lines)
