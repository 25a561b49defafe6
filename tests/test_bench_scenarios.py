"""Admission logic of the burst and sustained scenarios, with hand-made workflows (coroutines
that take a known time) in place of HTTP calls."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import pytest

from sluice.bench.metrics import WorkflowRecord
from sluice.bench.run import ScenarioSpec
from sluice.bench.scenarios import FixedSet, LoadGate, Window, run_closed_loop


class Tracker:
    """Workflows that sleep `duration(i)` seconds; records admissions and the most in flight."""

    def __init__(self, duration=lambda i: 0.02):
        self.duration = duration
        self.t0 = time.perf_counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.admitted: list[tuple[int, float]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self, index: int) -> WorkflowRecord:
        rec = WorkflowRecord(index=index, num_steps=1, admit_time=self.now())
        self.admitted.append((index, rec.admit_time))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.duration(index))
        self.in_flight -= 1
        rec.end_time, rec.completed, rec.calls = self.now(), True, 1
        return rec


def test_fixed_set_admits_each_index_once_in_order():
    fs = FixedSet(3)

    async def drain() -> list[Optional[int]]:
        return [await fs.admit() for _ in range(5)]

    assert asyncio.run(drain()) == [0, 1, 2, None, None]


@pytest.mark.parametrize("n,concurrency", [(10, 3), (2, 8), (7, 7), (0, 4)])
def test_burst_runs_every_workflow_with_bounded_concurrency(n: int, concurrency: int):
    tr = Tracker(duration=lambda i: 0.01 * (1 + i % 3))
    done = asyncio.run(run_closed_loop(FixedSet(n), concurrency, tr.run))
    assert sorted(w.index for w in done) == list(range(n))
    assert [i for i, _ in tr.admitted] == list(range(n))       # admitted in index order
    assert tr.max_in_flight == min(n, concurrency)
    assert all(w.completed for w in done)


def test_burst_admits_the_first_wave_at_once():
    tr = Tracker(duration=lambda i: 0.05)
    done = asyncio.run(run_closed_loop(FixedSet(8), 4, tr.run))
    first_end = min(w.end_time for w in done)
    assert all(t < first_end for i, t in tr.admitted if i < 4)
    assert all(t >= first_end for i, t in tr.admitted if i >= 4)


def _refilled_at_once(tr: Tracker, done: list[WorkflowRecord], concurrency: int) -> bool:
    """Every admission after the first wave happened as a workflow ended (no await between)."""
    ends = [w.end_time for w in done]
    return all(any(0 <= t - e < 0.01 for e in ends) for _, t in tr.admitted[concurrency:])


def test_window_with_manual_clock():
    clock = {"t": 0.0}
    w = Window(10.0, lambda: clock["t"], max_workflows=None)

    async def admit() -> Optional[int]:
        return await w.admit()

    assert asyncio.run(admit()) == 0
    clock["t"] = 9.99
    assert asyncio.run(admit()) == 1
    clock["t"] = 10.0
    assert asyncio.run(admit()) is None
    capped = Window(10.0, lambda: 0.0, max_workflows=2)
    assert [asyncio.run(capped.admit()) for _ in range(3)] == [0, 1, None]


def test_sustained_closed_loop_admits_until_the_window_closes_then_drains():
    tr = Tracker(duration=lambda i: 0.1)
    window = Window(0.35, tr.now)
    done = asyncio.run(run_closed_loop(window, 2, tr.run))
    assert all(t < 0.35 for _, t in tr.admitted)                 # nothing admitted after close
    assert 4 <= len(done) <= 8                                   # 2 slots x at most 4 waves
    assert tr.max_in_flight == 2
    assert max(w.end_time for w in done) > 0.35                  # admitted work drained
    assert all(w.completed for w in done)
    assert sorted(w.index for w in done) == list(range(len(done)))
    assert _refilled_at_once(tr, done, 2)


def test_sustained_replaces_a_finished_workflow_at_once():
    tr = Tracker(duration=lambda i: 0.02 if i == 0 else 0.3)
    done = asyncio.run(run_closed_loop(Window(0.15, tr.now), 2, tr.run))
    assert [i for i, _ in tr.admitted] == [0, 1, 2]              # 0's slot refilled; later ends: closed
    assert _refilled_at_once(tr, done, 2)


class ScriptedLoad:
    """A `/load` probe answering from a script (None: the server has no /load)."""

    def __init__(self, answers: list[Optional[dict[str, Any]]]):
        self.answers = list(answers)
        self.calls = 0
        self.asked: list[tuple[float, frozenset[int]]] = []   # (wait, pending) of each probe

    async def __call__(self, wait: float, pending: frozenset[int]) -> Optional[dict[str, Any]]:
        self.calls += 1
        self.asked.append((wait, pending))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_load_gate_waits_while_not_accepting():
    no, yes = {"accepting": False, "running": 4, "waiting": 9, "kv_usage": 0.99}, {"accepting": True}
    probe = ScriptedLoad([no, no, no, yes])
    gate = LoadGate(Window(60.0, lambda: 0.0), probe, poll_s=0.001)
    assert asyncio.run(gate.admit()) == 0
    assert gate.waits == 3 and gate.available is True


def test_waiting_slots_share_one_load_poller():
    """8 slots wait on a server that refuses for 0.2 s: they probe /load about twice per poll
    interval in all (each slot polling on its own would make ~80 probes), then all get in, and
    each admission is decided on its own `accepting` answer."""
    t0 = time.perf_counter()

    class Refusing:
        calls = 0

        async def __call__(self, wait: float, pending: frozenset[int]) -> dict[str, Any]:
            self.calls += 1
            await asyncio.sleep(0.001)    # an HTTP round trip
            return {"accepting": time.perf_counter() - t0 > 0.2}

    probe = Refusing()
    gate = LoadGate(Window(60.0, lambda: 0.0), probe, poll_s=0.02)

    async def slot() -> Optional[int]:
        index = await gate.admit()
        assert index is not None
        gate.arrived(index)           # its first call reached the server at once
        return index

    async def main() -> list[Optional[int]]:
        return await asyncio.gather(*(slot() for _ in range(8)))

    assert sorted(asyncio.run(main())) == list(range(8))
    refusals = probe.calls - 8                     # one accepting answer per admission
    # At least one refusal (the slots waited); at most about one poller's worth: a loaded machine
    # polls less often than every 0.02 s, never more (a lower bound of 5 failed once under load).
    assert 1 <= refusals <= 2 * 0.2 / 0.02 + 4
    assert gate.waits >= 8 * 5                      # every slot waited out the refusals
    assert gate.pending == set()


def test_load_gate_counts_its_own_admissions_until_they_arrive():
    """The server says it has room for 3 workflows and keeps saying so, since the admitted ones'
    first calls have not reached it: 8 free slots admit 3, not 8, until one arrives; then the
    server's answer counts that one and the gate's pending set no longer does."""
    probe = ScriptedLoad([{"accepting": True, "admissible_workflows": 3}])
    t0 = time.perf_counter()
    gate = LoadGate(Window(0.15, lambda: time.perf_counter() - t0), probe, poll_s=0.01)

    async def main() -> list[Optional[int]]:
        return await asyncio.gather(*(gate.admit() for _ in range(8)))

    got = asyncio.run(main())
    assert sorted(i for i in got if i is not None) == [0, 1, 2]
    assert got.count(None) == 5 and gate.pending == {0, 1, 2} and gate.waits > 5
    gate.arrived(1)
    gate.window = Window(60.0, lambda: 0.0)
    gate.window._next = 3
    assert asyncio.run(gate.admit()) == 3 and gate.pending == {0, 2, 3}


def test_load_gate_admits_one_at_a_time_from_a_server_with_only_accepting():
    probe = ScriptedLoad([{"accepting": True}])
    t0 = time.perf_counter()
    gate = LoadGate(Window(0.1, lambda: time.perf_counter() - t0), probe, poll_s=0.01)

    async def main() -> list[Optional[int]]:
        return await asyncio.gather(*(gate.admit() for _ in range(4)))

    got = asyncio.run(main())
    assert [i for i in got if i is not None] == [0] and got.count(None) == 3
    gate.arrived(0)
    gate.window = Window(60.0, lambda: 0.0)
    gate.window._next = 1
    assert asyncio.run(gate.admit()) == 1


def test_load_gate_takes_no_room_from_a_server_not_accepting():
    probe = ScriptedLoad([{"accepting": False, "admissible_workflows": 0}, {"accepting": True, "admissible_workflows": 2}])
    gate = LoadGate(Window(60.0, lambda: 0.0), probe, poll_s=0.001)
    assert asyncio.run(gate.admit()) == 0 and gate.waits == 1 and gate.pending == {0}


def test_load_gate_long_polls_once_the_server_answers_and_sends_what_is_pending():
    """The first probe asks without waiting (it tells whether there is a `/load`); later ones
    let the server hold the answer (`wait_s`) and name the workflows admitted but not arrived;
    while it has no room."""
    no, yes = {"accepting": False, "admissible_workflows": 0}, {"accepting": True, "admissible_workflows": 5}

    class Held(ScriptedLoad):
        async def __call__(self, wait: float, pending: frozenset[int]) -> Optional[dict[str, Any]]:
            await asyncio.sleep(wait)         # a long poll that runs out
            return await super().__call__(wait, pending)

    probe = Held([yes, no, no, yes])
    gate = LoadGate(Window(60.0, lambda: 0.0), probe, poll_s=0.01, wait_s=0.02)
    assert asyncio.run(gate.admit()) == 0 and probe.asked == [(0.0, frozenset())]
    assert asyncio.run(gate.admit()) == 1
    assert probe.asked[1:] == [(0.02, frozenset({0}))] * 3 and gate.waits >= 2
    assert gate.pending == {0, 1}


def test_load_gate_takes_off_only_the_pending_workflows_the_server_does_not_count():
    """Room for one, two workflows pending: with `pending_counted` 2 (both calls arrived before
    their first token came back) the gate admits; a server that says nothing about them leaves
    no room."""
    for counted, admitted in ((2, 2), (None, None)):
        doc = {"accepting": True, "admissible_workflows": 1}
        if counted is not None:
            doc["pending_counted"] = counted
        probe = ScriptedLoad([{"accepting": True, "admissible_workflows": 1}, doc])
        t0 = time.perf_counter()
        gate = LoadGate(Window(0.1, lambda: time.perf_counter() - t0), probe, poll_s=0.01, wait_s=0.0)
        gate.pending = {0, 1}
        gate.window._next = 2
        assert asyncio.run(gate.admit()) is None if admitted is None else asyncio.run(gate.admit()) == admitted
        assert probe.asked[-1][1] == frozenset({0, 1})


def test_load_gate_treats_a_failed_probe_after_the_first_as_no_room():
    yes = {"accepting": True, "admissible_workflows": 1}
    probe = ScriptedLoad([yes, None, None, yes])
    gate = LoadGate(Window(60.0, lambda: 0.0), probe, poll_s=0.001, wait_s=0.0)
    gate.arrived(0)
    assert asyncio.run(gate.admit()) == 0
    gate.arrived(0)
    assert asyncio.run(gate.admit()) == 1 and gate.available is True and gate.waits == 2


def test_load_gate_falls_back_without_load_endpoint():
    probe = ScriptedLoad([None])
    gate = LoadGate(Window(60.0, lambda: 0.0), probe, poll_s=0.001)
    assert [asyncio.run(gate.admit()) for _ in range(3)] == [0, 1, 2]
    assert gate.available is False and probe.calls == 1           # asked once, then plain loop


def test_load_gate_stops_when_the_window_closes_while_waiting():
    t0 = time.perf_counter()
    probe = ScriptedLoad([{"accepting": False}])
    gate = LoadGate(Window(0.05, lambda: time.perf_counter() - t0), probe, poll_s=0.005)
    assert asyncio.run(gate.admit()) is None
    assert gate.waits >= 1


def test_scenario_spec_validation():
    with pytest.raises(ValueError):
        ScenarioSpec(kind="steady")
    with pytest.raises(ValueError):
        ScenarioSpec(kind="burst", concurrency=0)
    assert ScenarioSpec(kind="sustained", window_s=60).describe()["window_s"] == 60
