"""`sluice bench soak`: sustained agent-workflow load with client aborts and malformed calls mixed
in, then a check that the server lost nothing and leaked nothing.

For `duration_s`, `concurrency` workflow slots run the benchmark's workflows (the same bodies as
`sluice bench sustained`). Before each call a slot may also send one malformed request
(`malformed_fraction`), and it abandons a share of its calls at a random moment
(`abort_fraction`: the client closes the stream uniformly within `abort_within_s`; the workflow
ends there, like an agent killed mid-step). A 429 is waited out and the call retried.

At the end the run passes when:
- no accepted call failed: every call answered 200 that the client did not abandon streamed to
  `[DONE]` with a finish reason, and no well-formed call got a status other than 200 or 429;
- every malformed request got a 4xx, and no request at all got a 5xx;
- no KV block leaked: after the drain the server reports nothing running or waiting and
  `sluice:kv_cache_blocks_used` and `..._retained` at 0 (retention pins expire after their TTL);
- resident memory (`process_resident_memory_bytes` in `/metrics`) grew by less than
  `max_rss_growth_mib` between the end of the warm-up and the end of the drain.

The server figures come from `/load` and `/metrics`; against a server without them (vLLM has no
block counters) the leak and memory checks report "unknown" and do not fail the run.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, TextIO

import httpx

from sluice.bench.client import CallRecord, CallStatus, Endpoint, get_json, make_http_client, stream_chat
from sluice.bench.metrics import WorkflowRecord
from sluice.bench.scenarios import Window, run_closed_loop
from sluice.bench.workload import (
    RequestTarget,
    WorkloadConfig,
    append_step,
    initial_messages,
    make_workflow,
    request_body,
    system_prompt,
    workflow_id,
)

_MIB = 1 << 20
_RETRIES_429 = 20


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0          # admission window; admitted workflows then finish
    concurrency: int = 16               # workflow slots
    abort_fraction: float = 0.1         # share of calls the client abandons
    abort_within_s: float = 3.0         # an abandoned call is closed uniformly within this many s
    malformed_fraction: float = 0.1     # chance, before each call, of one malformed request too
    warmup_s: float = 60.0              # the memory baseline is taken this long into the run
    max_rss_growth_mib: float = 100.0   # bound on resident memory growth after the warm-up
    drain_timeout_s: float = 60.0       # for the server to go idle and release every block
    call_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.concurrency < 1:
            raise ValueError("duration and concurrency must be positive")
        if not (0 <= self.abort_fraction <= 1 and 0 <= self.malformed_fraction <= 1):
            raise ValueError("fractions must be in [0, 1]")
        if self.warmup_s >= self.duration_s:
            raise ValueError("the warm-up must end before the run does")


def malformed_requests(model: str) -> list[tuple[str, str, bytes]]:
    """(name, path, body) of requests every OpenAI-compatible server must refuse with a 4xx."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def with_(**fields: Any) -> bytes:
        return json.dumps({**chat, **fields}).encode()

    return [
        ("invalid_json", "/chat/completions", b'{"model": "' + model.encode() + b'", "messages": ['),
        ("not_an_object", "/chat/completions", b"[1, 2, 3]"),
        ("missing_messages", "/chat/completions", json.dumps({"model": model}).encode()),
        ("empty_messages", "/chat/completions", with_(messages=[])),
        ("unknown_role", "/chat/completions", with_(messages=[{"role": "robot", "content": "x"}])),
        ("unknown_content_part", "/chat/completions",
         with_(messages=[{"role": "user", "content": [{"type": "video", "url": "x"}]}])),
        ("messages_wrong_type", "/chat/completions", with_(messages="hello")),
        ("max_tokens_zero", "/chat/completions", with_(max_tokens=0)),
        ("max_tokens_past_context", "/chat/completions", with_(max_tokens=10**9)),
        ("negative_temperature", "/chat/completions", with_(temperature=-1)),
        ("top_p_above_one", "/chat/completions", with_(top_p=1.5)),
        ("n_too_large", "/chat/completions", with_(n=10**6)),
        ("too_many_stops", "/chat/completions", with_(stop=[str(i) for i in range(1000)])),
        ("top_logprobs_too_large", "/chat/completions", with_(logprobs=True, top_logprobs=10**6)),
        ("invalid_utf8", "/chat/completions", with_().replace(b'"Hi"', b'"H\xff\xfe"')),
        ("lone_surrogate", "/chat/completions", with_().replace(b'"Hi"', b'"\\ud800"')),
        ("unknown_model", "/chat/completions", with_(model=model + "-no-such-model")),
        ("prompt_wrong_type", "/completions", json.dumps({"model": model, "prompt": {"a": 1}}).encode()),
        ("prompt_token_out_of_range", "/completions",
         json.dumps({"model": model, "prompt": [2**40], "max_tokens": 2}).encode()),
    ]


@dataclass
class ServerSnapshot:
    """What `/load` and `/metrics` say at one moment (None where the server has no such figure)."""

    running: Optional[int] = None
    waiting: Optional[int] = None
    blocks_used: Optional[float] = None
    blocks_retained: Optional[float] = None
    rss_bytes: Optional[float] = None
    aborts: Optional[float] = None

    @property
    def idle(self) -> bool:
        return not (self.running or self.waiting or self.blocks_used or self.blocks_retained)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> `{"name{labels}": value}`."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                continue
    return samples


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> Optional[float]:
    """Sum of the samples of `name` whose labels include `labels`; None if there is none."""
    total, found = 0.0, False
    for key, value in samples.items():
        base, _, label_text = key.partition("{")
        have = dict(re.findall(r'(\w+)="([^"]*)"', label_text))
        if base == name and all(have.get(k) == v for k, v in labels.items()):
            total, found = total + value, True
    return total if found else None


async def snapshot(http: httpx.AsyncClient, endpoint: Endpoint) -> ServerSnapshot:
    load = await get_json(http, endpoint.root_url + "/load", endpoint.headers())
    snap = ServerSnapshot()
    if isinstance(load, dict):
        snap.running, snap.waiting = load.get("running"), load.get("waiting")
    try:
        resp = await http.get(endpoint.root_url + "/metrics", headers=endpoint.headers(), timeout=10)
        samples = parse_metrics(resp.text) if resp.status_code == 200 else {}
    except httpx.HTTPError:
        samples = {}
    snap.blocks_used = metric_sum(samples, "sluice:kv_cache_blocks_used")
    snap.blocks_retained = metric_sum(samples, "sluice:kv_cache_blocks_retained")
    snap.rss_bytes = metric_sum(samples, "process_resident_memory_bytes")
    snap.aborts = metric_sum(samples, "sluice:request_success_total", finished_reason="abort")
    return snap


@dataclass
class SoakReport:
    config: SoakConfig
    workload: dict[str, Any]
    wall_time_s: float = 0.0
    workflows_started: int = 0
    workflows_completed: int = 0
    calls_ok: int = 0
    calls_aborted: int = 0              # abandoned by the client on purpose
    calls_refused: int = 0              # 429: not accepted (retried)
    output_tokens: int = 0
    malformed_sent: int = 0
    malformed_by_status: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)        # every response, well-formed or not
    failed_accepted: list[str] = field(default_factory=list)  # accepted calls that did not complete
    unexpected: list[str] = field(default_factory=list)       # malformed 2xx, any 5xx, other statuses
    server_aborts: Optional[float] = None                     # the server's abort counter, delta
    before: ServerSnapshot = field(default_factory=ServerSnapshot)   # at the end of the warm-up
    after: ServerSnapshot = field(default_factory=ServerSnapshot)    # after the drain
    rss_start_bytes: Optional[float] = None
    rss_peak_bytes: Optional[float] = None

    @property
    def rss_growth_mib(self) -> Optional[float]:
        if self.before.rss_bytes is None or self.after.rss_bytes is None:
            return None
        return (self.after.rss_bytes - self.before.rss_bytes) / _MIB

    @property
    def leaked_blocks(self) -> Optional[float]:
        if self.after.blocks_used is None:
            return None
        return self.after.blocks_used + (self.after.blocks_retained or 0)

    @property
    def failures(self) -> list[str]:
        out = []
        if self.failed_accepted:
            out.append(f"{len(self.failed_accepted)} accepted calls failed")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} unexpected responses")
        if self.after.running or self.after.waiting:
            out.append(f"not idle after the drain: {self.after.running} running, {self.after.waiting} waiting")
        if self.leaked_blocks:
            out.append(f"{self.leaked_blocks:g} KV blocks still referenced after the drain")
        growth = self.rss_growth_mib
        if growth is not None and growth > self.config.max_rss_growth_mib:
            out.append(f"resident memory grew {growth:.1f} MiB (bound {self.config.max_rss_growth_mib:g})")
        if self.calls_ok == 0:
            out.append("no call completed")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        def mib(x: Optional[float]) -> Optional[float]:
            return None if x is None else round(x / _MIB, 1)

        return {
            "passed": self.passed,
            "failures": self.failures,
            "config": self.config.__dict__,
            "workload": self.workload,
            "wall_time_s": round(self.wall_time_s, 1),
            "workflows_started": self.workflows_started,
            "workflows_completed": self.workflows_completed,
            "calls_ok": self.calls_ok,
            "calls_aborted_by_client": self.calls_aborted,
            "calls_refused_429": self.calls_refused,
            "output_tokens": self.output_tokens,
            "malformed_sent": self.malformed_sent,
            "malformed_by_status": {str(k): v for k, v in sorted(self.malformed_by_status.items())},
            "responses_by_status": {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))},
            "failed_accepted_calls": len(self.failed_accepted),
            "failed_accepted_examples": self.failed_accepted[:10],
            "unexpected_responses": len(self.unexpected),
            "unexpected_examples": self.unexpected[:10],
            "server_abort_count": self.server_aborts,
            "leaked_blocks": self.leaked_blocks,
            "after_drain": self.after.__dict__,
            "rss_mib": {"start": mib(self.rss_start_bytes), "after_warmup": mib(self.before.rss_bytes),
                        "peak": mib(self.rss_peak_bytes), "after_drain": mib(self.after.rss_bytes),
                        "growth_after_warmup": None if self.rss_growth_mib is None else round(self.rss_growth_mib, 1),
                        "bound": self.config.max_rss_growth_mib},
        }

    def table(self) -> str:
        d = self.to_json()
        rss = d["rss_mib"]
        rows = [
            ("result", "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)),
            ("wall time", f"{d['wall_time_s']} s (window {self.config.duration_s:g} s)"),
            ("workflows", f"{self.workflows_started} started, {self.workflows_completed} completed"),
            ("calls served", f"{self.calls_ok} ({self.output_tokens} output tokens)"),
            ("calls aborted by client", f"{self.calls_aborted} (server counted {_g(self.server_aborts)})"),
            ("calls refused (429)", str(self.calls_refused)),
            ("malformed requests", f"{self.malformed_sent}, by status {d['malformed_by_status']}"),
            ("responses by status", str(d["responses_by_status"])),
            ("failed accepted calls", str(len(self.failed_accepted))),
            ("unexpected responses", str(len(self.unexpected))),
            ("blocks leaked", _g(self.leaked_blocks)),
            ("RSS MiB", f"start {rss['start']}, after warm-up {rss['after_warmup']}, peak {rss['peak']}, "
                        f"after drain {rss['after_drain']}; growth {rss['growth_after_warmup']} "
                        f"(bound {rss['bound']:g})"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _g(x: Optional[float]) -> str:
    return "unknown" if x is None else f"{x:g}"


class SoakRunner:
    def __init__(self, http: httpx.AsyncClient, endpoint: Endpoint, model: str, workload: WorkloadConfig,
                 config: SoakConfig, report: SoakReport) -> None:
        self.http = http
        self.endpoint = endpoint
        self.workload = workload
        self.config = config
        self.report = report
        self.target = RequestTarget(model=model, run_id=f"soak{config.seed}")
        self.system = system_prompt(workload)
        self.malformed = malformed_requests(model)
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run_workflow(self, index: int) -> WorkflowRecord:
        rng = random.Random(f"sluice-soak/{self.config.seed}/{index}")
        wf = make_workflow(self.workload, index)
        rec = WorkflowRecord(index=index, num_steps=wf.num_steps, admit_time=self.now())
        self.report.workflows_started += 1
        headers = {"X-Workflow-Id": workflow_id(self.target, index)}
        messages = initial_messages(self.workload, wf, self.system)
        for j, step in enumerate(wf.steps):
            if rng.random() < self.config.malformed_fraction:
                await self.send_malformed(rng.choice(self.malformed))
            abort_at = rng.uniform(0.05, self.config.abort_within_s) if rng.random() < self.config.abort_fraction else None
            body = request_body(self.workload, self.target, wf, j, messages)
            call = await self.call(body, headers, index, j, step.output_tokens, abort_at)
            rec.calls += 1
            if call is None:           # abandoned on purpose, refused too often, or failed
                rec.end_time = self.now()
                return rec
            if j < wf.num_steps - 1:
                append_step(messages, step, step.reply)
                await asyncio.sleep(step.tool_latency_s)
        rec.end_time, rec.completed = self.now(), True
        self.report.workflows_completed += 1
        return rec

    async def call(self, body: dict[str, Any], headers: dict[str, str], index: int, step: int, max_tokens: int,
                   abort_at: Optional[float]) -> Optional[CallRecord]:
        """One call, retried after 429s; the record if it completed, else None."""
        what = f"workflow {index} step {step}"
        for _ in range(_RETRIES_429):
            record = CallRecord(workflow_index=index, step_index=step, max_tokens=max_tokens, send_time=0.0)
            timeout = abort_at if abort_at is not None else self.config.call_timeout_s
            await stream_chat(self.http, self.endpoint, body, record, t0=self.t0, timeout_s=timeout, headers=headers)
            self.report.statuses[record.http_status or "no_response"] += 1
            if record.http_status == 429:
                self.report.calls_refused += 1
                await asyncio.sleep(1.0)
                continue
            if record.ok and record.finish_reason:
                self.report.calls_ok += 1
                self.report.output_tokens += record.output_tokens
                return record
            if abort_at is not None and record.status is CallStatus.TIMEOUT:
                self.report.calls_aborted += 1
                return None
            if record.http_status == 200 or record.http_status is None:
                self.report.failed_accepted.append(f"{what}: {record.status.value}: {record.error or 'no finish reason'}")
            else:
                self.report.unexpected.append(f"{what}: well-formed call answered {record.error}")
            return None
        return None

    async def send_malformed(self, request: tuple[str, str, bytes]) -> None:
        name, path, body = request
        self.report.malformed_sent += 1
        try:
            resp = await self.http.post(self.endpoint.base_url + path, content=body, timeout=30,
                                        headers={**self.endpoint.headers(), "Content-Type": "application/json"})
        except httpx.HTTPError as e:
            self.report.malformed_by_status["no_response"] += 1
            self.report.unexpected.append(f"malformed {name}: {type(e).__name__}: {e}")
            return
        self.report.malformed_by_status[resp.status_code] += 1
        self.report.statuses[resp.status_code] += 1
        if not 400 <= resp.status_code < 500:
            self.report.unexpected.append(f"malformed {name}: HTTP {resp.status_code}: {resp.text[:200]}")


async def run_soak(endpoint: Endpoint, model: str, workload: WorkloadConfig, config: SoakConfig,
                   live: Optional[TextIO] = sys.stderr) -> SoakReport:
    report = SoakReport(config=config, workload=workload.describe())
    async with make_http_client(config.concurrency * 2) as http:
        start = await snapshot(http, endpoint)
        report.rss_start_bytes = report.rss_peak_bytes = start.rss_bytes
        runner = SoakRunner(http, endpoint, model, workload, config, report)

        async def monitor() -> None:
            warmed = False
            while True:
                await asyncio.sleep(min(5.0, config.warmup_s))
                snap = await snapshot(http, endpoint)
                if snap.rss_bytes is not None:
                    report.rss_peak_bytes = max(report.rss_peak_bytes or 0.0, snap.rss_bytes)
                if not warmed and runner.now() >= config.warmup_s:
                    report.before, warmed = snap, True
                if live is not None:
                    live.write(f"[{runner.now():7.1f}s] workflows {report.workflows_started} started, "
                               f"calls {report.calls_ok} ok / {report.calls_aborted} aborted / "
                               f"{report.calls_refused} refused, malformed {report.malformed_sent}, "
                               f"failed {len(report.failed_accepted)}, unexpected {len(report.unexpected)}\n")

        watcher = asyncio.create_task(monitor())
        try:
            await run_closed_loop(Window(config.duration_s, runner.now), config.concurrency, runner.run_workflow)
        finally:
            watcher.cancel()
        report.wall_time_s = runner.now()
        deadline = time.monotonic() + config.drain_timeout_s
        while True:
            report.after = await snapshot(http, endpoint)
            if report.after.idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        if report.after.aborts is not None and start.aborts is not None:
            report.server_aborts = report.after.aborts - start.aborts
        if report.before.rss_bytes is None:
            report.before = start
    return report
