"""One benchmark run against one endpoint, and `--repeats` of it."""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, TextIO

import httpx

from sluice.bench.client import CallRecord, Endpoint, get_json, make_http_client
from sluice.bench.metrics import Summary, WorkflowRecord, summarize
from sluice.bench.progress import Progress
from sluice.bench.scenarios import (
    Admission,
    FixedSet,
    LoadGate,
    SentBody,
    Window,
    WorkflowRunner,
    load_probe,
    run_closed_loop,
)
from sluice.bench.workload import RequestTarget, WorkloadConfig

BURST = "burst"
SUSTAINED = "sustained"


@dataclass(frozen=True)
class ScenarioSpec:
    kind: str                              # BURST or SUSTAINED
    concurrency: int = 32                  # most workflows in flight
    workflows: int = 96                    # burst: the fixed set
    window_s: float = 1800.0               # sustained: admission window
    max_workflows: Optional[int] = None    # sustained: optional cap on admissions
    admission: str = "closed"              # sustained: "closed" or "load" (poll GET /load)
    timeout_s: float = 600.0               # per call, whole stream

    def __post_init__(self) -> None:
        if self.kind not in (BURST, SUSTAINED):
            raise ValueError(f"unknown scenario {self.kind!r}")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.admission not in ("closed", "load"):
            raise ValueError("admission is 'closed' or 'load'")
        if self.timeout_s <= 0:
            raise ValueError("timeout must be positive")

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"scenario": self.kind, "concurrency": self.concurrency, "call_timeout_s": self.timeout_s}
        if self.kind == BURST:
            d["workflows"] = self.workflows
        else:
            d.update(window_s=self.window_s, max_workflows=self.max_workflows, admission=self.admission)
        return d


@dataclass
class RunResult:
    repeat: int
    seed: int
    run_id: str
    started_at: str                         # UTC, ISO 8601
    wall_time_s: float
    calls: list[CallRecord]
    workflows: list[WorkflowRecord]
    summary: Summary
    load_gate: Optional[str] = None         # sustained --admission load: "used" / "unavailable"
    bodies: list[SentBody] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "repeat": self.repeat,
            "seed": self.seed,
            "run_id": self.run_id,
            "started_at": self.started_at,
            "wall_time_s": self.wall_time_s,
            "load_gate": self.load_gate,
            "summary": self.summary.to_json(),
            "workflows": [w.to_json() for w in sorted(self.workflows, key=lambda w: w.index)],
            "calls": [c.to_json() for c in sorted(self.calls, key=lambda c: (c.workflow_index, c.step_index))],
        }


async def fetch_model(endpoint: Endpoint) -> Optional[str]:
    """The first model id `GET /v1/models` lists."""
    async with make_http_client(1) as http:
        doc = await get_json(http, endpoint.base_url + "/models", endpoint.headers())
    try:
        return str(doc["data"][0]["id"])  # type: ignore[index]
    except (TypeError, KeyError, IndexError):
        return None


async def server_info(endpoint: Endpoint) -> dict[str, Any]:
    """What the server says about itself: `/v1/models`, and `/version` where it has one."""
    async with make_http_client(1) as http:
        models = await get_json(http, endpoint.base_url + "/models", endpoint.headers())
        version = await get_json(http, endpoint.root_url + "/version", endpoint.headers())
    return {"base_url": endpoint.base_url, "models": models, "version": version}


async def answers(endpoint: Endpoint, timeout_s: float = 2.0) -> bool:
    """Whether anything answers HTTP at the endpoint (any status), e.g. a server left running."""
    async with make_http_client(1) as http:
        try:
            await http.get(endpoint.base_url + "/models", headers=endpoint.headers(), timeout=timeout_s)
        except httpx.HTTPError:
            return False
    return True


async def wait_ready(endpoint: Endpoint, timeout_s: float, alive: Optional[Callable[[], bool]] = None) -> None:
    """Poll `GET /v1/models` until it answers 200; `alive()` False aborts (a launched server died)."""
    deadline = time.monotonic() + timeout_s
    async with make_http_client(1) as http:
        while time.monotonic() < deadline:
            if alive is not None and not alive():
                raise RuntimeError(f"server for {endpoint.base_url} exited before it was ready")
            if await get_json(http, endpoint.base_url + "/models", endpoint.headers(), timeout_s=2.0) is not None:
                return
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{endpoint.base_url} not ready within {timeout_s:g} s")


async def run_once(
    endpoint: Endpoint,
    target: RequestTarget,
    spec: ScenarioSpec,
    workload: WorkloadConfig,
    *,
    repeat: int = 0,
    keep_bodies: bool = False,
    live: Optional[TextIO] = sys.stderr,
    live_every_s: Optional[float] = None,
) -> RunResult:
    """Run the scenario once; `live` gets the progress display (None: silent)."""
    progress = Progress()
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    async with make_http_client(spec.concurrency) as http:
        t0 = time.perf_counter()
        runner = WorkflowRunner(
            http, endpoint, workload, target,
            t0=t0, timeout_s=spec.timeout_s, progress=progress, keep_bodies=keep_bodies,
        )
        gate: Optional[LoadGate] = None
        admission: Admission
        if spec.kind == BURST:
            admission = FixedSet(spec.workflows)
            target_text = f" (of {spec.workflows})"
        else:
            window = Window(spec.window_s, runner.now, spec.max_workflows)
            admission = window
            if spec.admission == "load":
                gate = LoadGate(window, load_probe(http, endpoint, target))
                admission = gate
                runner.on_arrival = gate.arrived
            target_text = ""
        display = asyncio.create_task(progress.display(t0, target=target_text, stream=live, every_s=live_every_s)) if live else None
        try:
            workflows = await run_closed_loop(admission, spec.concurrency, runner.run)
        finally:
            if display is not None:
                display.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await display
        wall = time.perf_counter() - t0
    if live is not None:
        live.write(progress.line(wall, progress.tokens / wall if wall > 0 else 0.0, target_text) + "\n")
    load_gate = None if gate is None else ("used" if gate.available else "unavailable")
    return RunResult(
        repeat=repeat,
        seed=workload.seed,
        run_id=target.run_id,
        started_at=started_at,
        wall_time_s=wall,
        calls=runner.calls,
        workflows=workflows,
        summary=summarize(runner.calls, workflows, wall),
        load_gate=load_gate,
        bodies=runner.bodies,
    )


def default_run_id(seed: int) -> str:
    """Deterministic, so that bodies (which carry `workflow_id`) match across engines."""
    return f"s{seed}"


async def run_repeats(
    endpoint: Endpoint,
    model: str,
    spec: ScenarioSpec,
    workload: WorkloadConfig,
    *,
    repeats: int = 1,
    first: int = 0,
    of: Optional[int] = None,
    run_id: Optional[str] = None,
    send_workflow_fields: bool = True,
    keep_bodies: bool = False,
    live: Optional[TextIO] = sys.stderr,
) -> list[RunResult]:
    """Repeats first .. first + repeats - 1 of a series of `of` (default: these), repeat r with
    seed `workload.seed + r`: a fresh workload each time, so no repeat finds the previous one's
    prompts in the server's prefix cache; the same seeds on every engine. `compare` interleaving
    two engines runs one repeat at a time with `first` and `of`."""
    of = first + repeats if of is None else of
    results = []
    for r in range(first, first + repeats):
        wl = replace(workload, seed=workload.seed + r)
        rid = run_id if run_id and of == 1 else (f"{run_id}-r{r}" if run_id else default_run_id(wl.seed))
        target = RequestTarget(model=model, run_id=rid, send_workflow_fields=send_workflow_fields)
        if live is not None and of > 1:
            live.write(f"repeat {r + 1}/{of} (seed {wl.seed}) against {endpoint.base_url}\n")
        results.append(await run_once(endpoint, target, spec, wl, repeat=r, keep_bodies=keep_bodies, live=live))
    return results
