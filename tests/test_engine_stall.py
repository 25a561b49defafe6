"""The engine's guard against a scheduler that stops scheduling: steps that schedule nothing while
requests are unfinished end those requests with an error after `stall_timeout_s`, instead of
leaving their clients waiting forever, and the engine serves the next requests as before.

The fault is injected (the scheduler's `schedule` replaced by one that returns empty steps): a
correct scheduler never does that for long, which the scheduler tests check with their own
empty-step bound (tests/sched_utils.py). The engine's clock is a fake one, advanced a second per
step, so the test does not sleep."""
from __future__ import annotations

from pathlib import Path

import pytest

from sluice import LLM, SamplingParams
from sluice.engine.scheduler import SchedulerOutput

MODEL = Path.home() / ".cache" / "sluice" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "Once upon a time,"]


class FakeClock:
    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


@pytest.fixture(scope="module")
def llm() -> LLM:
    if not MODEL.exists():
        pytest.skip("default model not downloaded")
    return LLM(str(MODEL), max_model_len=512, kv_cache_tokens=2048)


def stall_for(llm: LLM, monkeypatch: pytest.MonkeyPatch, empty_steps: int, after: int = 0) -> None:
    """After `after` real steps, the scheduler schedules nothing for its next `empty_steps` calls,
    then works again. Past 1000 empty steps the test fails instead of hanging."""
    scheduler = llm.engine.scheduler
    real = type(scheduler).schedule.__get__(scheduler)   # the scheduler's own, not an earlier patch
    left = [after, empty_steps]

    def schedule() -> SchedulerOutput:
        if left[0] > 0:
            left[0] -= 1
            return real()
        if left[1] > 0:
            left[1] -= 1
            assert empty_steps - left[1] <= 1000, "the engine never gave up on the stalled requests"
            return SchedulerOutput()
        return real()

    monkeypatch.setattr(scheduler, "schedule", schedule)


def test_a_stalled_scheduler_fails_its_requests_and_the_engine_goes_on(llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    expected = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)]
    monkeypatch.setattr(engine, "clock", FakeClock(step_s=1.0))
    timeout = engine.config.stall_timeout_s
    stalls = engine.num_stalls

    # A stall shorter than the timeout is waited out: the requests finish as usual.
    stall_for(llm, monkeypatch, empty_steps=int(timeout) - 5)
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)] == expected
    assert engine.num_stalls == stalls

    # One that lasts ends every unfinished request with an error, and holds nothing after: calls
    # still waiting (the stall from the start), and calls running with KV (after two steps).
    scheduler = engine.scheduler
    for after, stall in ((0, 1), (2, 2)):
        stall_for(llm, monkeypatch, empty_steps=10 ** 6, after=after)
        failed = llm.generate(PROMPTS, PARAMS)
        assert engine.num_stalls == stalls + stall
        for out in failed:
            assert out.finished and out.outputs[0].finish_reason == "error"
            assert out.error is not None and "could not schedule" in out.error
            assert len(out.outputs[0].token_ids) == after   # one token per real step
        assert not scheduler.has_unfinished() and not scheduler.running and not scheduler.waiting
        scheduler.check_invariants()
        assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks

    # The engine goes on: the next requests run as before the fault.
    stall_for(llm, monkeypatch, empty_steps=0)
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, PARAMS)] == expected
    assert engine.num_stalls == stalls + 2


def test_stall_timeout_is_a_server_flag_and_must_be_positive() -> None:
    import argparse

    from sluice.cli import add_engine_args, build_engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert build_engine_config(parser.parse_args([])).stall_timeout_s == 30.0
    assert build_engine_config(parser.parse_args(["--stall-timeout", "2.5"])).stall_timeout_s == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match="stall timeout"):
            build_engine_config(parser.parse_args(["--stall-timeout", bad]))
