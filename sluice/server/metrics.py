"""Prometheus metrics for /metrics, under vLLM's names with a `sluice:` prefix.

Three sources feed one per-app registry:
- engine state (gauges and cumulative counters) is read from `engine.stats()` at scrape time;
- per-request latencies and finish reasons are observed by the server as outputs stream out
  (one `RequestRecorder` per engine request);
- the process itself (`process_resident_memory_bytes`, CPU seconds, open files), which the soak
  test reads to bound memory growth.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.engine.stats import EngineStats
from sluice.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    """Exposes one `EngineStats` snapshot per scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield self._gauge("sluice:num_requests_running", "Requests in the running batch.", s.num_running)
        yield self._gauge("sluice:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield self._gauge("sluice:num_waiting_tokens", "Prompt tokens of waiting requests still to compute.",
                          s.num_waiting_tokens)
        yield self._gauge("sluice:num_workflows", "Workflows with state in the engine.", s.num_workflows)
        yield self._gauge("sluice:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", s.kv_usage)
        yield self._gauge("sluice:kv_cache_blocks_total", "KV blocks in the pool.", s.kv_blocks_total)
        yield self._gauge("sluice:kv_cache_blocks_used", "KV blocks referenced by running or waiting requests.",
                          s.kv_blocks_used)
        yield self._gauge("sluice:kv_cache_blocks_retained",
                          "KV blocks pinned for a workflow's next call and referenced by no request.",
                          s.kv_blocks_retained)
        yield self._gauge("sluice:kv_cache_blocks_evictable", "Cached, unreferenced, reclaimable KV blocks.",
                          s.kv_blocks_evictable)
        yield self._gauge("sluice:kv_cache_blocks_free", "Empty KV blocks.", s.kv_blocks_free)
        yield self._gauge("sluice:state_slots_total", "Recurrent-state sequence slots (hybrid models; else 0).",
                          s.state_slots_total)
        yield self._gauge("sluice:state_slots_used", "Recurrent-state slots held by running requests.",
                          s.state_slots_used)
        yield self._gauge("sluice:state_snapshots_total", "Recurrent-state snapshot slots for the prefix cache.",
                          s.state_snapshots_total)
        yield self._gauge("sluice:state_snapshots", "Recurrent-state snapshots kept for the prefix cache.",
                          s.state_snapshots_used)
        yield self._gauge("sluice:accepting_requests", "1 when admission control accepts new work.",
                          1.0 if s.accepting else 0.0)
        yield self._gauge("sluice:admissible_workflows", "New workflows admission control welcomes now.",
                          float(s.admissible_workflows))
        yield self._gauge("sluice:active_workflows", "Workflows in flight: a call running or waiting, or KV "
                          "retained for the next.", s.active_workflows)
        yield self._gauge("sluice:max_active_workflows", "The bound on workflows in flight that GET /load keeps "
                          "(0: none; with --max-active-workflows auto, the engine's current choice).",
                          s.max_active_workflows or 0)
        if s.engine_overhead is not None:
            yield self._gauge("sluice:engine_overhead", "Share of the engine's last control period spent on "
                              "per-step fixed cost or idle (--max-active-workflows auto).", s.engine_overhead)
        if s.engine_step_ratio is not None:
            yield self._gauge("sluice:engine_step_ratio", "The engine's mean step over what the mean call's own "
                              "prompt costs, a moving average (--auto-step-ratio).", s.engine_step_ratio)
        yield self._counter("sluice:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("sluice:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
                            s.prefix_cache_hits)
        yield self._counter("sluice:num_preemptions", "Preemptions.", s.num_preemptions)
        yield self._counter("sluice:decode_yield_steps", "Steps whose running decodes sat out for waiting prompts.",
                            s.decode_yield_steps)
        yield self._counter("sluice:engine_stalls", "Times calls the scheduler left unscheduled for the stall "
                            "timeout were failed (a scheduler fault).", s.engine_stalls)
        yield self._counter("sluice:prompt_tokens", "Prompt tokens computed.", s.prompt_tokens_total)
        yield self._counter("sluice:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield self._counter("sluice:spec_decode_num_drafts", "Speculative verifications with drafts.",
                            s.spec_drafts_total)
        yield self._counter("sluice:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                            s.spec_draft_tokens_total)
        yield self._counter("sluice:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            s.spec_accepted_tokens_total)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        prometheus_client.disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(stats, model_name))
        ProcessCollector(registry=self.registry)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "sluice:time_to_first_token_seconds", "Time from request arrival to its first output token.",
            _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "sluice:inter_token_latency_seconds", "Time between consecutive outputs of a request.", _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "sluice:e2e_request_latency_seconds", "Time from request arrival to its last output.", _E2E_BUCKETS)
        # vLLM's request phase histograms, from the engine's own timestamps: waiting until first
        # scheduled, then until the first token (prefill, with any queueing behind other work's
        # steps), then until the last token. The engine thread takes requests in between steps,
        # so TTFT minus queue and prefill is the rest of the step running when the request came
        # in, plus tokenization and delivery.
        self.request_queue_time = histogram(
            "sluice:request_queue_time_seconds",
            "Time from the engine taking a request in until it is first scheduled.", _TTFT_BUCKETS)
        self.request_prefill_time = histogram(
            "sluice:request_prefill_time_seconds", "Time from first scheduled to the first output token.",
            _TTFT_BUCKETS)
        self.request_decode_time = histogram(
            "sluice:request_decode_time_seconds", "Time from the first to the last output token.", _E2E_BUCKETS)
        self._request_success = Counter(
            "sluice:request_success", "Finished requests by finish reason.",
            labels + ["finished_reason"], registry=self.registry,
        )
        for reason in ("stop", "length", "abort", "error"):
            self._request_success.labels(model_name, reason)

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def recorder(self, arrival: float) -> "RequestRecorder":
        return RequestRecorder(self, arrival)


class RequestRecorder:
    """Latency bookkeeping of one engine request, fed with each output as it arrives.

    `arrival` is a `time.monotonic()` reading taken when the HTTP request came in. A request
    counts once in `request_success`, by the finish reason of its first sample ("error" if any
    sample failed), or as "abort" if it is closed before finishing. A request the engine
    rejected is `discard`ed: it never started, so it is not counted.
    """

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._last_token_time: Optional[float] = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        times = output.token_times
        if times:
            # TTFT as the client sees it (arrival to the output's delivery); the gaps between the
            # engine steps that made tokens, one per step, also where an output carries several
            # steps' tokens (a stream interval, a non-streamed call).
            if self._last_token_time is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
                last, rest = times[0], times[1:]
            else:
                last, rest = self._last_token_time, times
            for t in rest:
                self._metrics.inter_token_latency.observe(t - last)
                last = t
            self._last_token_time = last
        if output.finished:
            self._observe_phases(output.metrics)
            reasons = [o.finish_reason for o in output.outputs if o.finish_reason]
            reason = "error" if "error" in reasons else (reasons[0] if reasons else "stop")
            self._finish(reason, now)

    def _observe_phases(self, m: dict) -> None:
        """Queue, prefill and decode time of a finished request, from the engine's clock."""
        arrival, scheduled = m.get("arrival_time"), m.get("scheduled_time")
        first, finish = m.get("first_token_time"), m.get("finish_time")
        if arrival is None or scheduled is None or first is None or finish is None:
            return  # finished without a token (aborted before its first step)
        self._metrics.request_queue_time.observe(max(0.0, scheduled - arrival))
        self._metrics.request_prefill_time.observe(max(0.0, first - scheduled))
        self._metrics.request_decode_time.observe(max(0.0, finish - first))

    def close(self, reason: str = "abort") -> None:
        """The request ended without a finished output: the client went away ("abort") or the
        engine failed ("error")."""
        if not self._done:
            self._finish(reason, time.monotonic())

    def discard(self) -> None:
        self._done = True

    def _finish(self, reason: str, now: float) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.e2e_request_latency.observe(now - self._arrival)
        self._metrics.request_finished(reason)
