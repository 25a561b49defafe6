"""Workload determinism and shape: same seed, same workflows and request bodies."""
from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, settings, strategies as st

from sluice.bench.workload import (
    WORDS,
    FloatRange,
    History,
    IntRange,
    RequestTarget,
    WorkloadConfig,
    approx_tokens,
    make_workflow,
    synthetic_bodies,
    system_prompt,
)

TARGET = RequestTarget(model="m", run_id="s0")


def _bodies(cfg: WorkloadConfig, n: int) -> str:
    return json.dumps([synthetic_bodies(cfg, TARGET, i) for i in range(n)], sort_keys=True)


def test_same_seed_same_bodies():
    assert _bodies(WorkloadConfig(seed=7), 12) == _bodies(WorkloadConfig(seed=7), 12)


def test_different_seed_different_bodies():
    assert _bodies(WorkloadConfig(seed=7), 4) != _bodies(WorkloadConfig(seed=8), 4)


def test_same_bodies_in_a_fresh_interpreter():
    """No dependence on PYTHONHASHSEED or on process state."""
    code = (
        "import json; from sluice.bench.workload import *;"
        "print(json.dumps([synthetic_bodies(WorkloadConfig(seed=3), RequestTarget('m', 's0'), i) for i in range(5)],"
        " sort_keys=True))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {_bodies(WorkloadConfig(seed=3), 5)}


def test_workflow_independent_of_other_indices():
    cfg = WorkloadConfig(seed=1)
    forward = [make_workflow(cfg, i) for i in range(10)]
    backward = [make_workflow(cfg, i) for i in reversed(range(10))][::-1]
    assert forward == backward
    assert len({w.task for w in forward}) == 10


def test_body_shape_and_workflow_fields():
    cfg = WorkloadConfig(seed=2)
    wf = make_workflow(cfg, 4)
    bodies = synthetic_bodies(cfg, RequestTarget("smol", "run"), 4)
    assert len(bodies) == wf.num_steps
    for j, (b, step) in enumerate(zip(bodies, wf.steps)):
        assert b["model"] == "smol"
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert b["ignore_eos"] is True and b["max_tokens"] == step.output_tokens
        assert b["workflow_id"] == "run-4"
        assert b.get("is_last_step", False) is (j == wf.num_steps - 1)
    plain = synthetic_bodies(cfg, RequestTarget("smol", "run", send_workflow_fields=False), 4)
    assert all("workflow_id" not in b and "is_last_step" not in b for b in plain)


def test_conversation_grows_by_reply_and_tool_result():
    cfg = WorkloadConfig(seed=5, steps=IntRange(4, 4))
    wf = make_workflow(cfg, 0)
    bodies = synthetic_bodies(cfg, TARGET, 0)
    assert bodies[0]["messages"][0] == {"role": "system", "content": system_prompt(cfg)}
    assert bodies[0]["messages"][1] == {"role": "user", "content": wf.task}
    for j in range(1, len(bodies)):
        prev, cur = bodies[j - 1]["messages"], bodies[j]["messages"]
        assert cur[: len(prev)] == prev
        assert cur[len(prev)] == {"role": "assistant", "content": wf.steps[j - 1].reply}
        assert cur[len(prev) + 1]["role"] == "user"
        assert wf.steps[j - 1].tool_result in cur[len(prev) + 1]["content"]
        assert len(cur) == len(prev) + 2


def test_system_prompt_shared_and_sized():
    cfg = WorkloadConfig(seed=9)
    assert approx_tokens(system_prompt(cfg)) == cfg.system_tokens
    firsts = {json.dumps(synthetic_bodies(cfg, TARGET, i)[0]["messages"][0]) for i in range(6)}
    assert len(firsts) == 1
    assert system_prompt(WorkloadConfig(system_tokens=0)) == ""


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), index=st.integers(0, 10_000))
def test_draws_within_stated_distributions(seed: int, index: int):
    cfg = WorkloadConfig(seed=seed)
    wf = make_workflow(cfg, index)
    assert cfg.steps.lo <= wf.num_steps <= cfg.steps.hi
    assert cfg.task_tokens.lo <= wf.task_tokens <= cfg.task_tokens.hi
    assert approx_tokens(wf.task) == wf.task_tokens + 2          # "Task <i>:" prefix
    for j, s in enumerate(wf.steps):
        assert cfg.output_tokens.lo <= s.output_tokens <= cfg.output_tokens.hi
        assert approx_tokens(s.reply) == s.output_tokens
        if j == wf.num_steps - 1:
            assert s.tool_result == "" and s.tool_latency_s == 0.0
        else:
            assert 1 <= s.tool_result_tokens <= cfg.tool_result_max
            assert approx_tokens(s.tool_result) == s.tool_result_tokens
            assert cfg.tool_latency_s.lo <= s.tool_latency_s <= cfg.tool_latency_s.hi


def test_lognormal_tool_results_have_the_stated_median():
    cfg = WorkloadConfig(seed=0)
    lengths = sorted(s.tool_result_tokens for i in range(400) for s in make_workflow(cfg, i).steps[:-1])
    median = lengths[len(lengths) // 2]
    assert 0.85 * cfg.tool_result_median < median < 1.15 * cfg.tool_result_median


def test_scaled_shrinks_lengths_and_latency_not_steps():
    cfg = WorkloadConfig().scaled(0.1)
    assert cfg.system_tokens == 40
    assert cfg.task_tokens == IntRange(5, 15)
    assert cfg.output_tokens == IntRange(4, 16)
    assert cfg.steps == WorkloadConfig().steps
    assert cfg.tool_latency_s == FloatRange(0.05, 0.2)
    assert cfg.tool_result_median == 25.0


def test_words_are_plain_single_words():
    assert len(set(WORDS)) == len(WORDS) >= 150
    assert all(w.isalpha() and w.islower() for w in WORDS)


def test_history_modes():
    assert WorkloadConfig().history is History.SYNTHETIC
    assert History("actual") is History.ACTUAL


def test_bench_imports_nothing_of_the_engine():
    code = (
        "import sys, sluice.bench.cli;"
        "bad = [m for m in sys.modules if m.split('.')[:2] in (['sluice','engine'], ['sluice','model'],"
        " ['sluice','server']) or m == 'torch'];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
