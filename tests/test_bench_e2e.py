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

import httpx
import matplotlib.image as mpimg
import pytest

from server_utils import RemoteServer, free_port, metric, scrape_metrics
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


@pytest.fixture(scope="module")
def server():
    """One plain server for the tests that only drive one (the compare tests launch their own)."""
    with RemoteServer(["--max-model-len", "2048"]) as s:
        yield s


def test_burst_against_sluice_serve(server: RemoteServer, tmp_path: Path):
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


def test_the_runner_tells_when_a_workflows_first_call_reached_the_server(server: RemoteServer):
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

    runner, completed = asyncio.run(main(server.base_url))
    assert completed and len(runner.calls) == make_workflow(_workload(), 5).num_steps
    first = runner.calls[0]
    assert [(i, n) for i, _, n in arrivals] == [(5, 0), (5, 0)]     # during the first call, twice
    assert first.first_token_time <= arrivals[0][1] <= first.end_time


def _serve_cmd(port: int) -> str:
    return f"{sys.executable} -m sluice.cli serve --host 127.0.0.1 --port {port} --max-model-len 2048"


@pytest.mark.parametrize("order", ["interleaved", "sequential"])
def test_compare_launches_each_side_and_pairs_the_repeats(tmp_path: Path, order: str):
    """`sluice bench compare --a-cmd/--b-cmd`: each side's server is launched for its turn and
    stopped after it; interleaved, a fresh one for every repeat, the pairs alternating A B, B A.
    Both sides run the same seeds, and the table gives A/B for each pair of runs."""
    port_a, port_b = free_port(), free_port()
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "sluice.cli", "bench", "compare",
           "--a", f"http://127.0.0.1:{port_a}/v1", "--a-label", "first", "--a-cmd", _serve_cmd(port_a),
           "--b", f"http://127.0.0.1:{port_b}/v1", "--b-label", "second", "--b-cmd", _serve_cmd(port_b),
           "--startup-timeout", "240", "--repeats", "2", "--order", order, "--quiet",
           *BENCH_ARGS, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    starts = [line.split(":", 1)[0] for line in proc.stderr.splitlines() if line.startswith("starting ")]
    if order == "interleaved":
        assert starts == ["starting A", "starting B", "starting B", "starting A"]
        assert sorted(p.name for p in out.glob("*.server.*log")) == [
            "a.server.r0.log", "a.server.r1.log", "b.server.r0.log", "b.server.r1.log"]
    else:
        assert starts == ["starting A", "starting B"]
        assert sorted(p.name for p in out.glob("*.server.*log")) == ["a.server.log", "b.server.log"]
    for port in (port_a, port_b):   # every launched server was stopped
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)

    docs = {side: json.loads((out / side / "results.json").read_text()) for side in ("a", "b")}
    for side, label in (("a", "first"), ("b", "second")):
        runs = docs[side]["runs"]
        assert docs[side]["label"] == label and [r["repeat"] for r in runs] == [0, 1]
        assert [r["seed"] for r in runs] == [11, 12]
        assert all(r["summary"]["completed_workflows"] == 2 for r in runs)
    started = {side: [r["started_at"] for r in docs[side]["runs"]] for side in ("a", "b")}
    if order == "interleaved":
        assert started["a"][0] <= started["b"][0] <= started["b"][1] <= started["a"][1]
    else:
        assert started["a"][1] <= started["b"][0]

    compare = json.loads((out / "compare.json").read_text())
    assert compare["order"] == order
    pairs = compare["ratio_a_over_b_by_repeat"]
    for key in ("output_throughput", "ttft_p50", "output_tokens"):
        a = [r["summary"][key] for r in docs["a"]["runs"]]
        b = [r["summary"][key] for r in docs["b"]["runs"]]
        assert pairs[key] == pytest.approx([x / y for x, y in zip(a, b)])
    assert pairs["output_tokens"] == [1.0, 1.0]   # same seeds: the same workload on both sides
    ci = compare["ratio_a_over_b_ci95"]["output_tokens"]
    assert (ci["geometric_mean"], ci["low"], ci["high"]) == pytest.approx((1.0, 1.0, 1.0))
    ci = compare["ratio_a_over_b_ci95"]["output_throughput"]
    assert ci["low"] <= ci["geometric_mean"] <= ci["high"]
    assert "A/B by repeat" in proc.stdout and "(95% CI 1.00-1.00)" in proc.stdout and f"order: {order}" in (out / "compare.md").read_text()


def test_compare_refuses_to_launch_onto_a_port_something_already_serves(server: RemoteServer, tmp_path: Path):
    """A server left running on A's port would take A's runs while the launched one fails to
    bind, and nothing in the results would say so (it happened: three A/B comparisons measured a
    leftover server). `compare` refuses before launching anything."""
    leftover, other = server, free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "bench", "compare",
           "--a", leftover.base_url, "--a-cmd", _serve_cmd(leftover.port),
           "--b", f"http://127.0.0.1:{other}/v1", "--b-cmd", _serve_cmd(other),
           "--quiet", *BENCH_ARGS, "--out", str(tmp_path / "cmp")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"A: something already answers at {leftover.base_url}" in proc.stderr
    assert "starting" not in proc.stderr and not (tmp_path / "cmp" / "compare.json").exists()
    assert httpx.get(leftover.url + "/health", timeout=5).status_code == 200   # left alone


def test_the_auto_bound_on_workflows_in_flight_rises_while_small_steps_leave_the_engine_idle(tmp_path: Path):
    """`sluice serve` (`--max-active-workflows auto`, the default) driven by `sluice bench
    sustained --admission load` with more client slots than the initial bound: `/load` reports
    the bound, it starts at WorkflowLimit.INITIAL, and with this tiny workload (steps of a few
    rows, mostly fixed cost) it rises; every admitted workflow completes, and `/metrics` shows
    the overhead it follows."""
    from sluice.engine.admission import WorkflowLimit

    with RemoteServer(["--max-model-len", "2048"]) as s:
        load = httpx.get(s.url + "/load").json()
        assert load["max_active_workflows"] == WorkflowLimit.INITIAL and load["active_workflows"] == 0
        seen: list[tuple[int, int]] = []

        async def watch(stop: asyncio.Event) -> None:
            async with httpx.AsyncClient() as http:
                while not stop.is_set():
                    got = (await http.get(s.url + "/load")).json()
                    seen.append((got["active_workflows"], got["max_active_workflows"]))
                    await asyncio.sleep(0.25)

        async def main() -> subprocess.CompletedProcess[str]:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            cmd = [sys.executable, "-m", "sluice.cli", "bench", "sustained", "--base-url", s.base_url,
                   "--concurrency", "12", "--window", "25", "--admission", "load", "--scale", "0.1",
                   "--seed", "3", "--out", str(tmp_path / "run")]
            proc = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=600)
            stop.set()
            await watcher
            return proc

        proc = asyncio.run(main())
        assert proc.returncode == 0, proc.stdout + proc.stderr + s.log()
        summary = json.loads((tmp_path / "run" / "results.json").read_text())["runs"][0]["summary"]
        assert summary["completed_workflows"] == summary["admitted_workflows"] > WorkflowLimit.INITIAL
        assert summary["errors"] == {}
        bounds = [b for _, b in seen]
        assert min(bounds) >= WorkflowLimit.MINIMUM and max(bounds) > WorkflowLimit.INITIAL, seen
        assert max(a for a, _ in seen) > WorkflowLimit.INITIAL
        samples = scrape_metrics(s)
        assert metric(samples, "sluice:max_active_workflows") >= WorkflowLimit.MINIMUM
        assert 0.0 <= metric(samples, "sluice:engine_overhead") <= 1.0
