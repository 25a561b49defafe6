"""End to end: a real `sluice serve` on loopback, `sluice bench burst` with two tiny workflows,
and the results folder it leaves. No speed assertions."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from server_utils import RemoteServer
from sluice.bench.client import Endpoint, make_http_client
from sluice.bench.progress import Progress
from sluice.bench.run import fetch_model
from sluice.bench.scenarios import WorkflowRunner
from sluice.bench.workload import IntRange, RequestTarget, WorkloadConfig, make_workflow, synthetic_bodies

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sluice.server.api_server") is None, reason="sluice.server.api_server not present"
)

BENCH_ARGS = ["--workflows", "2", "--concurrency", "2", "--scale", "0.1", "--steps", "2-3", "--seed", "11"]


def _workload() -> WorkloadConfig:
    """What BENCH_ARGS ask for."""
    return WorkloadConfig(seed=11, steps=IntRange(2, 3)).scaled(0.1)


def _bench(base_url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "sluice.cli", "bench", "burst", "--base-url", base_url,
           *BENCH_ARGS, "--out", str(out), "--manifest", str(out / "manifest.jsonl"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONHASHSEED": "0"})


def test_burst_against_sluice_serve(tmp_path: Path):
    with RemoteServer(["--max-model-len", "2048"]) as server:
        proc = _bench(server.base_url, tmp_path / "run")
        assert proc.returncode == 0, proc.stdout + proc.stderr + server.log()
    out = tmp_path / "run"
    assert "Aggregate output throughput" in proc.stdout
    assert "workflows:" in proc.stderr                       # the progress display's final line

    doc = json.loads((out / "results.json").read_text())
    assert doc["scenario"]["scenario"] == "burst" and doc["repeats"] == 1
    run = doc["runs"][0]
    s = run["summary"]
    wfs = [make_workflow(_workload(), i) for i in range(2)]
    assert (s["admitted_workflows"], s["completed_workflows"]) == (2, 2)
    assert s["total_calls"] == s["ok_calls"] == sum(w.num_steps for w in wfs)
    assert s["errors"] == {}

    calls = run["calls"]
    assert [(c["workflow_index"], c["step_index"]) for c in calls] == [
        (w.index, j) for w in wfs for j in range(w.num_steps)
    ]
    for c, (w, j) in zip(calls, [(w, j) for w in wfs for j in range(w.num_steps)]):
        assert c["status"] == "ok" and c["http_status"] == 200
        assert c["output_tokens_from_usage"], "server did not report usage in the stream"
        assert c["output_tokens"] == w.steps[j].output_tokens      # max_tokens + ignore_eos honoured
        assert c["prompt_tokens"] is not None and c["prompt_tokens"] > 0
        assert c["send_time"] <= c["first_token_time"] <= c["last_token_time"] <= c["end_time"]
        assert len(c["chunk_times"]) == c["num_chunks"] >= 1
    assert s["output_tokens"] == sum(st.output_tokens for w in wfs for st in w.steps)
    assert s["ttft_p50"] is not None and s["output_throughput"] > 0

    md = (out / "summary.md").read_text()
    assert "| Aggregate output throughput (tok/s) |" in md and "TTFT p90" in md
    for png in ("throughput.png", "ttft.png"):
        img = mpimg.imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200

    model = doc["server"]["model"]
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    expected = [b for i in range(2) for b in synthetic_bodies(_workload(), RequestTarget(model, "s11"), i)]
    assert [line["body"] for line in lines] == expected
    assert lines[0]["headers"] == {"X-Workflow-Id": "s11-0"}
    summary = json.loads((out / "manifest.summary.json").read_text())
    assert summary["runs"][0]["calls"] == len(lines)
    assert summary["runs"][0]["prompt_tokens_server"]["count"] == len(lines)


def test_the_runner_tells_when_a_workflows_first_call_reached_the_server():
    """`--admission load` counts a workflow it admitted against the server's room until the
    workflow's first call is there: the runner says so on that call's first chunk (and once more
    when the call ends, in case it had none)."""
    arrivals: list[tuple[int, float, int]] = []

    async def main(base_url: str) -> tuple[WorkflowRunner, bool]:
        endpoint = Endpoint.from_url(base_url)
        model = await fetch_model(endpoint)
        assert model is not None
        async with make_http_client(1) as http:
            runner = WorkflowRunner(
                http, endpoint, _workload(), RequestTarget(model, "arrival"),
                t0=time.perf_counter(), timeout_s=120, progress=Progress(),
                on_arrival=lambda i: arrivals.append((i, runner.now(), len(runner.calls))),
            )
            rec = await runner.run(5)
            return runner, rec.completed

    with RemoteServer(["--max-model-len", "2048"]) as server:
        runner, completed = asyncio.run(main(server.base_url))
    assert completed and len(runner.calls) == make_workflow(_workload(), 5).num_steps
    first = runner.calls[0]
    assert [(i, n) for i, _, n in arrivals] == [(5, 0), (5, 0)]     # during the first call, twice
    assert first.first_token_time <= arrivals[0][1] <= first.end_time
