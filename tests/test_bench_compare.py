"""`sluice bench compare` bookkeeping without servers: the order of turns, and what is kept when
a turn fails part way (each side's runs are stubbed with hand-made records)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import sluice.bench.cli as cli
from sluice.bench.client import CallRecord, CallStatus
from sluice.bench.metrics import WorkflowRecord, summarize
from sluice.bench.run import RunResult


def _run(repeat: int, tokens: int) -> RunResult:
    calls = [CallRecord(workflow_index=0, step_index=0, max_tokens=tokens, send_time=0.0, first_token_time=0.5,
                        last_token_time=2.0, end_time=2.0, num_chunks=tokens, output_tokens=tokens,
                        output_tokens_from_usage=True, status=CallStatus.OK, http_status=200)]
    workflows = [WorkflowRecord(0, 1, admit_time=0.0, end_time=2.0, completed=True, calls=1)]
    return RunResult(repeat=repeat, seed=11 + repeat, run_id=f"s{11 + repeat}", started_at=f"t{repeat}",
                     wall_time_s=2.0, calls=calls, workflows=workflows,
                     summary=summarize(calls, workflows, wall_time_s=2.0))


def _stub_sides(monkeypatch, fail_at=None):
    """Side A makes 20 tokens a run, B 10; the turn `fail_at` = (side, repeat) raises."""
    turns = []

    def run_side(side, args, spec, workload, out, first=0, repeats=None):
        turns.append((side, first))
        if (side, first) == fail_at:
            raise SystemExit(f"{side.upper()}: the server launched by --{side}-cmd exited during the run")
        count = args.repeats if repeats is None else repeats
        runs = [_run(r, 20 if side == "a" else 10) for r in range(first, first + count)]
        return f"label-{side}", runs, {"side": side}

    monkeypatch.setattr(cli, "_run_side", run_side)
    return turns


def _argv(out: Path, order: str = "interleaved") -> list[str]:
    return ["compare", "--scenario", "burst", "--a", "http://127.0.0.1:1/v1", "--b", "http://127.0.0.1:2/v1",
            "--workflows", "1", "--concurrency", "1", "--repeats", "3", "--order", order, "--quiet",
            "--out", str(out)]


def test_interleaved_pairs_alternate_which_side_goes_first(tmp_path, monkeypatch):
    turns = _stub_sides(monkeypatch)
    assert cli.main(_argv(tmp_path / "cmp")) == 0
    assert turns == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    compare = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert compare["ratio_a_over_b_by_repeat"]["output_throughput"] == pytest.approx([2.0, 2.0, 2.0])
    assert "incomplete" not in compare


@pytest.mark.parametrize("fail_at, done_a, done_b", [
    (("b", 1), [0], [0]),        # the third turn fails: one pair kept
    (("a", 1), [0], [0, 1]),     # the fourth: B's second run kept too, compared over repeat 0 only
])
def test_a_failed_turn_keeps_the_runs_already_measured(tmp_path, monkeypatch, fail_at, done_a, done_b):
    out = tmp_path / "cmp"
    turns = _stub_sides(monkeypatch, fail_at)
    with pytest.raises(SystemExit, match="exited during the run"):
        cli.main(_argv(out))
    assert turns[-1] == fail_at
    for side, done in (("a", done_a), ("b", done_b)):
        doc = json.loads((out / side / "results.json").read_text())
        assert [r["repeat"] for r in doc["runs"]] == done and doc["label"] == f"label-{side}"
    compare = json.loads((out / "compare.json").read_text())
    assert compare["ratio_a_over_b_by_repeat"]["output_throughput"] == pytest.approx([2.0])
    assert "stopped early" in compare["incomplete"] and "1 of 3 repeats" in compare["incomplete"]
    assert "**Incomplete**" in (out / "compare.md").read_text()


def test_a_failure_before_any_pair_writes_no_comparison(tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    _stub_sides(monkeypatch, ("b", 0))
    with pytest.raises(SystemExit):
        cli.main(_argv(out))
    assert json.loads((out / "a" / "results.json").read_text())["runs"][0]["repeat"] == 0
    assert not (out / "b").exists() and not (out / "compare.json").exists()
