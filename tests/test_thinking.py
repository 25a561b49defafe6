"""A sequence's thought (engine/thinking.py) on hand-built token sequences: where it opens and
closes, which positions thinking_token_budget forces, the same answers through drafts as token by
token, the drafts' overlay, and where a grammar waiting for the thought starts; then the config
that gives the engine its tags."""
from __future__ import annotations

import random

import pytest

from sluice.config import ReasoningConfig, reasoning_tags
from sluice.engine.thinking import ThinkingTags, ThoughtTracker
from sluice.sampling_params import SamplingParams

S, E = 1, 2                      # one-token start and end tags
TAGS = ThinkingTags(start=(S,), end=(E,), forced=(E,))
PHRASE = ThinkingTags(start=(S,), end=(E,), forced=(7, 8, E))      # "time to answer" then the end tag
MULTI = ThinkingTags(start=(3, 4), end=(5, 4), forced=(9, 5, 4))   # tags of two tokens each


def run(tags: ThinkingTags, budget: int, prompt: list[int], model: list[int]) -> tuple[list[int], list]:
    """Decode token by token: the model's wish at each position unless it is forced. The output
    and the forced token of each position."""
    tb = ThoughtTracker(tags, budget, prompt)
    out, forced = [], []
    for want in model:
        f = tb.forced(prompt + out)
        tok = f[0] if f is not None else None
        forced.append(tok)
        out.append(tok if tok is not None else want)
    return out, forced


def test_a_thought_the_prompt_opens_is_cut_at_the_budget() -> None:
    prompt = [10, 11, S]
    out, forced = run(TAGS, 3, prompt, [20, 21, 22, 23, 24, 25])
    assert out == [20, 21, 22, E, 24, 25] and forced == [None, None, None, E, None, None]
    # the prompt's own thought tokens count: two already there leave one
    out, _ = run(TAGS, 3, [10, S, 30, 31], [20, 21, 22])
    assert out == [20, E, 22]
    # a prompt thought already past its budget: the first token is the end
    assert run(TAGS, 1, [S, 30, 31], [20, 21])[0] == [E, 21]
    # budget 0 closes an opened thought at once
    assert run(TAGS, 0, [10, S], [20, 21])[0] == [E, 21]


def test_a_thought_that_ends_in_time_is_left_alone_and_a_closed_prompt_forces_nothing() -> None:
    assert run(TAGS, 3, [10, S], [20, E, 21, 22, 23, 24])[0] == [20, E, 21, 22, 23, 24]
    assert run(TAGS, 0, [10, S, 11, E], [20, 21, 22])[0] == [20, 21, 22]
    assert run(TAGS, 2, [10, 11], [20, 21, 22, 23])[0] == [20, 21, 22, 23]


def test_the_output_opening_a_thought_and_a_second_thought_get_budgets_of_their_own() -> None:
    model = [S, 20, 21, 22, 23, 30, S, 24, E, 31, S, 25, 26, 27]
    out, _ = run(TAGS, 2, [10], model)
    assert out == [S, 20, 21, E, 23, 30, S, 24, E, 31, S, 25, 26, E]


def test_a_forced_phrase_is_written_whole_even_where_the_model_writes_the_end() -> None:
    out, forced = run(PHRASE, 1, [S], [20, E, 21, 22, 23])
    assert out == [20, 7, 8, E, 23] and forced == [None, 7, 8, E, None]
    # multi-token tags: the end spelled in two tokens closes the thought, a start likewise opens it
    out, _ = run(MULTI, 2, [10, 3, 4], [20, 21, 22, 23, 24, 3, 4, 5, 4, 26])
    assert out == [20, 21, 9, 5, 4, 3, 4, 5, 4, 26]
    # a thought's budget spent on the first token of the end tag: the forced end follows it
    out, _ = run(MULTI, 2, [10, 3, 4], [25, 5, 4, 26, 27, 28])
    assert out == [25, 5, 9, 5, 4, 28]


def test_forced_through_drafts_is_what_token_by_token_gives() -> None:
    """Random prompts and outputs over a small vocabulary rich in tag tokens: each position's forced
    token asked through drafts (any split of the output into tokens and drafts, on one object that
    advances incrementally) equals what a fresh object says for the tokens before that position."""
    rng = random.Random(0)
    for tags in (TAGS, PHRASE, MULTI):
        for _ in range(300):
            budget = rng.randrange(0, 5)
            prompt = [rng.choice([S, E, 3, 4, 5, 10]) for _ in range(rng.randrange(1, 6))]
            model = [rng.choice([S, E, 3, 4, 5, 9, 20, 21]) for _ in range(rng.randrange(1, 14))]
            out, _ = run(tags, budget, prompt, model)
            expected = [(ThoughtTracker(tags, budget, prompt).forced(prompt + out[:p]) or [None])[0]
                        for p in range(len(out) + 1)]
            tb = ThoughtTracker(tags, budget, prompt)
            for cut in range(len(out) + 1):
                got = tb.forced(prompt + out[:cut], out[cut:])
                assert (got or [None] * (len(out) - cut + 1)) == expected[cut:], (tags, budget, prompt, out, cut)


def test_overlay_drafts_the_forced_end() -> None:
    tb = ThoughtTracker(PHRASE, 2, [10, S])
    assert tb.overlay([10, S, 20], [21, 22, 23], 6) == [21, 7, 8, E]    # the rest followed other tokens
    assert tb.overlay([10, S, 20], [], 6) == []                           # nothing to copy before the budget
    assert tb.overlay([10, S, 20, 21], [], 2) == [7, 8]                   # forced tokens drafted from nothing
    assert tb.overlay([10, S, 20, 21], [7, 8, E, 30], 6) == [7, 8, E, 30]  # drafts that agree go on
    assert tb.overlay([10, S, 20], [21, 30], 1) == [21]


def test_tokens_dropped_from_the_output_are_forgotten() -> None:
    tb = ThoughtTracker(TAGS, 2, [S])
    assert tb.forced([S, 20, 21]) == [E]
    assert tb.forced([S, 20]) is None          # a tail dropped (speculated past a stop string)
    assert tb.forced([S, 20, E, 21]) is None


def test_reasoning_config_from_vllms_keys() -> None:
    assert reasoning_tags(None) is None
    assert reasoning_tags("glm45") == ReasoningConfig()
    cfg = reasoning_tags("glm45", {"reasoning_end_str": "Time to answer.</think>"})
    assert (cfg.start, cfg.end, cfg.forced) == ("<think>", "</think>", "Time to answer.</think>")
    cfg = reasoning_tags(None, {"reasoning_start_str": "<r>", "reasoning_end_str": "</r>"})
    assert (cfg.start, cfg.end, cfg.forced) == ("<r>", "</r>", "</r>")
    for bad in ({"reasoning_end_str": "</r>"}, {"reasoning_start_str": "<r>", "reasoning_end_str": 3},
                {"reasoning_start_str": "<r>", "reasoning_end_str": "</r>", "think_str": "x"},
                {"reasoning_start_str": "", "reasoning_end_str": "</r>"}):
        with pytest.raises(ValueError):
            reasoning_tags(None, bad)
    with pytest.raises(ValueError):
        reasoning_tags("nope")


def test_the_budget_is_a_non_negative_integer() -> None:
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            SamplingParams(thinking_token_budget=bad)


def test_where_a_thought_closes_through_drafts() -> None:
    tb = ThoughtTracker(TAGS, None, [10, S])                 # no budget: it only tracks
    assert tb.opens_in_prompt and tb.is_open([10, S, 20])
    assert tb.closes([10, S, 20], [21, E, 22]) == 2          # after the end tag, the third position
    assert tb.closes([10, S, 20], [21, 22]) is None
    assert tb.forced([10, S, 20, 21, 22, 23]) is None and tb.overlay([10, S], [20, 21], 5) == [20, 21]
    assert not tb.is_open([10, S, 20, E])
    assert tb.closes([10, S, 20, E], [S, 21]) == 0           # closed already (a new thought does not undo that)
    # a forced end closes it when it is written whole
    tb = ThoughtTracker(PHRASE, 1, [S])
    assert tb.closes([S], [20, 7, 8, E]) == 4 and tb.closes([S, 20, 7], [8]) is None
    assert not ThoughtTracker(TAGS, None, [10, S, 11, E]).opens_in_prompt
    assert not ThoughtTracker(MULTI, None, [3, 4, 20, 5, 4]).opens_in_prompt
    assert ThoughtTracker(MULTI, None, [5, 4, 3, 4]).opens_in_prompt
