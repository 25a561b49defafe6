"""The two traffic scenarios: admission policies and the closed loop that runs workflows.

Both scenarios are the same loop: `concurrency` slots, each admitting the next workflow index
as soon as its previous workflow ends, until the admission policy says stop. What differs is
the policy:

- burst (`FixedSet`): indices 0..n-1, then stop. At most `concurrency` in flight, the first
  `concurrency` admitted at once.
- sustained (`Window`): keep admitting while the window (seconds since the first admission) is
  open; work admitted before it closes then drains. Both engines get the same first workflows;
  a faster engine admits more.
- sustained with `LoadGate`: like `Window`, but before each admission polls the server's
  `GET /load` and waits while it has no room for another workflow (`accepting: false`, or as
  many workflows admitted and not yet arrived as it said it had room for). A server without
  `/load` (vLLM) makes the gate fall back to the plain closed loop for the rest of the run.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Protocol
from urllib.parse import urlencode

import httpx

from sluice.bench.client import CallRecord, Endpoint, get_json, stream_chat
from sluice.bench.metrics import WorkflowRecord
from sluice.bench.progress import Progress
from sluice.bench.workload import (
    History,
    RequestTarget,
    WorkloadConfig,
    append_step,
    initial_messages,
    make_workflow,
    request_body,
    system_prompt,
    workflow_id,
)

Clock = Callable[[], float]


class Admission(Protocol):
    """Decides, when a slot frees, which workflow index to admit next (None: admit no more)."""

    async def admit(self) -> Optional[int]: ...


class FixedSet:
    """Burst: workflows 0..n-1 in order."""

    def __init__(self, n: int):
        if n < 0:
            raise ValueError("number of workflows must be non-negative")
        self.n = n
        self._next = 0

    async def admit(self) -> Optional[int]:
        if self._next >= self.n:
            return None
        i, self._next = self._next, self._next + 1
        return i


class Window:
    """Sustained: the next index while `clock()` (seconds since the run's start) is below
    `window_s`, and fewer than `max_workflows` (if given) were admitted."""

    def __init__(self, window_s: float, clock: Clock, max_workflows: Optional[int] = None):
        if window_s <= 0:
            raise ValueError("window must be positive")
        self.window_s = window_s
        self.clock = clock
        self.max_workflows = max_workflows
        self._next = 0

    @property
    def is_open(self) -> bool:
        capped = self.max_workflows is not None and self._next >= self.max_workflows
        return not capped and self.clock() < self.window_s

    async def admit(self) -> Optional[int]:
        if not self.is_open:
            return None
        i, self._next = self._next, self._next + 1
        return i


# probe(wait, pending): the `/load` document, held by the server up to `wait` seconds until it has
# room for a workflow beyond the `pending` ones (indices the gate admitted whose first call has
# not come back; a server without the long poll answers at once); None when there is none (the
# first answer) or it failed.
LoadProbe = Callable[[float, frozenset[int]], Awaitable[Optional[dict[str, Any]]]]


class LoadGate:
    """Sustained with server feedback: a `Window` that admits only while the server's `/load`
    has room for another workflow. `probe()` returns the parsed `/load` document or None when
    there is none; the first None makes the gate a plain `Window` for good (`available` becomes
    False).

    The room is `admissible_workflows` (how many new workflows the server welcomes now; a server
    with only `accepting` gives one while it accepts), less the workflows this gate admitted
    whose first call has not reached the server yet (`pending`, until `arrived(index)`): the
    server cannot count those, and admitting on every `accepting` answer meanwhile let 20 slots
    in within 0.1 s over HTTP, where the in-process replay (which sees its admissions at once)
    never did.

    A server that knows better says so: sent the pending workflows' ids (`GET
    /load?pending=...`), sluice's answers `pending_counted`, how many of them its
    `admissible_workflows` counts already (their calls arrived before their first token came
    back), and only the others are taken off.

    The slots share one poller, as a router in front of the server would, and each admission is
    decided on a fresh answer. While there is no room the poller long-polls (`wait=wait_s`):
    sluice's server holds the answer until there is room, so the gate asks about once per
    admission. Polling twice per 0.1 s instead took ~2% of a core in this client and ~1% in the
    server, on the two cores the engine computes on (docs/benchmarks.md, session 43: a foreign
    thread's CPU costs the engine's steps more than its own share). A server that answers at once
    is asked about twice per `poll_s` (32 slots each polling at 10 Hz put ~320 HTTP requests a
    second on the server being measured). Only the first answer decides whether the server has
    a `/load`: a later failed probe counts as no room."""

    def __init__(self, window: Window, probe: LoadProbe, poll_s: float = 0.1, wait_s: float = 1.0):
        self.window = window
        self.probe = probe
        self.poll_s = poll_s
        self.wait_s = wait_s
        self.available: Optional[bool] = None   # unknown until the first probe
        self.waits = 0                          # times a slot waited: no room
        self.pending: set[int] = set()          # admitted; first call not yet at the server
        self._lock = asyncio.Lock()
        self._refused_at: Optional[float] = None   # when the last probe found no room

    def arrived(self, index: int) -> None:
        """Workflow `index`'s first call reached the server (its first chunk came back, or it
        ended): the server's `/load` counts it from now on."""
        self.pending.discard(index)

    async def _room(self) -> Optional[int]:
        """New workflows the server has room for, less `pending`; a refusal less than half a
        `poll_s` old stands (a slot that slept `poll_s` after one asks again). None when the
        server has no `/load`. At most ~2 probes per `poll_s` while there is no room."""
        now = time.monotonic()
        if self._refused_at is not None and now - self._refused_at < self.poll_s / 2:
            return 0
        # Held only once the server is known to answer: the first probe tells whether it has a
        # `/load` at all, and must not keep the first slots waiting.
        sent = frozenset(self.pending)
        load = await self.probe(self.wait_s if self.available else 0.0, sent)
        if load is None or not isinstance(load.get("accepting"), bool):
            if self.available:
                self._refused_at = time.monotonic()   # a failed probe: no room this time
                return 0
            return None
        room = load.get("admissible_workflows")
        if not isinstance(room, int) or isinstance(room, bool):
            room = 1                            # a server that only says yes or no
        counted = load.get("pending_counted")
        if not isinstance(counted, int) or isinstance(counted, bool):
            counted = 0                         # a server that cannot tell
        # Against the pending set the answer is about: one that arrived meanwhile is counted.
        room = room - (len(sent) - counted) if load["accepting"] else 0
        self._refused_at = None if room > 0 else time.monotonic()
        return room

    async def admit(self) -> Optional[int]:
        while self.window.is_open and self.available is not False:
            async with self._lock:
                asked = time.monotonic()
                room = await self._room()
                if room is None:
                    self.available = False
                    break
                self.available = True
                if room > 0:
                    index = await self.window.admit()
                    if index is not None:
                        self.pending.add(index)
                    return index
            self.waits += 1
            # A long poll that waited has paced the loop already.
            await asyncio.sleep(max(0.0, self.poll_s - (time.monotonic() - asked)))
        return await self.window.admit()


async def run_closed_loop(
    admission: Admission, concurrency: int, run_workflow: Callable[[int], Awaitable[WorkflowRecord]]
) -> list[WorkflowRecord]:
    """`concurrency` slots, each admitting and running workflows until admission stops; returns
    when every admitted workflow has finished (the drain). Records in completion order."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    done: list[WorkflowRecord] = []

    async def slot() -> None:
        while (index := await admission.admit()) is not None:
            done.append(await run_workflow(index))

    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return done


@dataclass(frozen=True)
class SentBody:
    """A request as it went out, for the manifest."""

    workflow_index: int
    step_index: int
    headers: dict[str, str]
    body: dict[str, Any]


class WorkflowRunner:
    """Runs workflows against one endpoint, collecting call records (times relative to `t0`)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        endpoint: Endpoint,
        workload: WorkloadConfig,
        target: RequestTarget,
        *,
        t0: float,
        timeout_s: float,
        progress: Progress,
        keep_bodies: bool = False,
        on_arrival: Optional[Callable[[int], None]] = None,
    ):
        """`on_arrival(index)` is told when workflow `index`'s first call reached the server (its
        first chunk came back, or the call ended without one)."""
        self.http = http
        self.endpoint = endpoint
        self.workload = workload
        self.target = target
        self.t0 = t0
        self.timeout_s = timeout_s
        self.progress = progress
        self.keep_bodies = keep_bodies
        self.on_arrival = on_arrival
        self.system = system_prompt(workload)
        self.calls: list[CallRecord] = []
        self.bodies: list[SentBody] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self, index: int) -> WorkflowRecord:
        wf = make_workflow(self.workload, index)
        rec = WorkflowRecord(index=index, num_steps=wf.num_steps, admit_time=self.now())
        self.progress.admitted += 1
        headers = {"X-Workflow-Id": workflow_id(self.target, index)}
        messages = initial_messages(self.workload, wf, self.system)
        for j, step in enumerate(wf.steps):
            body = request_body(self.workload, self.target, wf, j, messages)
            if self.keep_bodies:
                self.bodies.append(SentBody(index, j, headers, body))
            call = CallRecord(workflow_index=index, step_index=j, max_tokens=step.output_tokens, send_time=0.0)
            self.progress.in_flight += 1
            on_chunk = self.progress.add_tokens
            if j == 0 and self.on_arrival is not None:
                on_chunk = self._first_chunk_tells(self.on_arrival, index, on_chunk)
            await stream_chat(
                self.http, self.endpoint, body, call,
                t0=self.t0, timeout_s=self.timeout_s, headers=headers, on_chunk=on_chunk,
            )
            if j == 0 and self.on_arrival is not None:
                self.on_arrival(index)
            self.progress.in_flight -= 1
            self.calls.append(call)
            rec.calls += 1
            self.progress.call_done(call)
            if not call.ok:
                rec.end_time = self.now()
                self.progress.failed += 1
                return rec
            if j < wf.num_steps - 1:
                reply = step.reply if self.workload.history is History.SYNTHETIC else call.text
                append_step(messages, step, reply)
                await asyncio.sleep(step.tool_latency_s)
        rec.end_time = self.now()
        rec.completed = True
        self.progress.completed += 1
        return rec

    @staticmethod
    def _first_chunk_tells(tell: Callable[[int], None], index: int,
                           on_chunk: Callable[[int], None]) -> Callable[[int], None]:
        told = False

        def chunk(n: int) -> None:
            nonlocal told
            if not told:
                told = True
                tell(index)
            on_chunk(n)

        return chunk


def load_probe(http: httpx.AsyncClient, endpoint: Endpoint, target: RequestTarget) -> LoadProbe:
    async def probe(wait: float, pending: frozenset[int]) -> Optional[dict[str, Any]]:
        params = {}
        if wait > 0:
            params["wait"] = f"{wait:g}"
        if pending:
            params["pending"] = ",".join(workflow_id(target, i) for i in sorted(pending))
        url = endpoint.root_url + "/load" + ("?" + urlencode(params) if params else "")
        doc = await get_json(http, url, endpoint.headers(), timeout_s=wait + 2.0)
        return doc if isinstance(doc, dict) else None

    return probe
