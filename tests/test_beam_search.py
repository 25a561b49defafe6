"""The beam search itself (engine/beam_search.py) on hand-made logprobs: which candidates become
beams, which finish, and how the output is ranked. The engine's runs of it against transformers
are in test_model_smollm2.py, the server's in test_server.py."""
from __future__ import annotations

import math

import pytest

from sluice.engine.beam_search import BeamSearch
from sluice.outputs import Logprob
from sluice.sampling_params import MAX_BEAM_WIDTH, ParamError, SamplingParams

EOS = 0


def entry(**probs: float) -> dict[int, Logprob]:
    """{token: Logprob} from t<id>=probability."""
    ranked = sorted(probs.items(), key=lambda kv: -kv[1])
    return {int(name[1:]): Logprob(int(name[1:]), math.log(p), rank) for rank, (name, p) in enumerate(ranked, start=1)}


def search(width: int = 2, max_tokens: int = 3, prompt_len: int = 4, **params) -> BeamSearch:
    """A search over a 4-token prompt with EOS 0; `params`: the request's other SamplingParams."""
    return BeamSearch(prompt_len, SamplingParams(n=width, use_beam_search=True, max_tokens=max_tokens, **params),
                      max_tokens, (EOS,))


def test_each_step_keeps_the_width_best_candidates_over_all_beams():
    s = search(width=2)
    s.advance([entry(t5=0.5, t6=0.3, t7=0.1, t8=0.05)])          # one beam: its 4 best are candidates
    assert [b.token_ids for b in s.beams] == [[5], [6]]
    s.advance([entry(t9=0.4, t10=0.4, t11=0.1, t12=0.1),          # beam [5]: 0.5 * 0.4 = 0.2 twice
               entry(t13=0.9, t14=0.05, t15=0.03, t16=0.02)])     # beam [6]: 0.3 * 0.9 = 0.27
    assert [b.token_ids for b in s.beams] == [[6, 13], [5, 9]]    # the tie goes to the earlier beam's likelier token
    assert s.beams[0].cumulative_logprob == pytest.approx(math.log(0.27))
    assert len(s.beams[0].logprobs) == 2 and s.steps == 2 and not s.done


def test_only_the_2w_most_likely_tokens_of_a_beam_are_candidates():
    s = search(width=1)
    s.advance([entry(t5=0.4, t6=0.3, t7=0.2, t8=0.1)])
    # beam [5]'s entry holds more tokens than 2w = 2 (the request's own `logprobs` may ask for more)
    s.advance([entry(t1=0.3, t2=0.3, t3=0.2, t4=0.2)])
    assert s.beams[0].token_ids == [5, 1]


def test_an_end_token_finishes_a_beam_and_does_not_take_a_live_slot():
    s = search(width=2, max_tokens=4)
    s.advance([entry(t0=0.6, t5=0.3, t6=0.1)])
    assert [b.token_ids for b in s.finished] == [[]]               # EOS is not kept in the output
    assert s.finished[0].finish_reason == "stop" and s.finished[0].stop_reason is None
    assert [b.token_ids for b in s.beams] == [[5], [6]]           # two live beams still


def test_ignore_eos_makes_eos_an_ordinary_candidate_and_stop_token_ids_still_end():
    s = search(width=2, ignore_eos=True, stop_token_ids=[7])
    s.advance([entry(t0=0.6, t7=0.3, t6=0.1)])
    assert [b.token_ids for b in s.beams] == [[0], [6]]
    assert [(b.token_ids, b.stop_reason) for b in s.finished] == [([], 7)]


def test_min_tokens_holds_the_end_back():
    s = search(width=1, min_tokens=1)
    s.advance([entry(t0=0.9, t5=0.1)])
    assert not s.finished and s.beams[0].token_ids == [5]
    s.advance([entry(t0=0.9, t5=0.1)])
    assert [b.token_ids for b in s.finished] == [[5]]


def test_the_output_ranks_by_logprob_over_the_length_with_the_prompt():
    # prompt 4 tokens. Finished [] (EOS first): log 0.3 / 4 = -0.301. Live [5, 6]: log 0.25 / 6 =
    # -0.231, [5, 7]: log 0.15 / 6 = -0.316.
    s = search(width=2, max_tokens=2)
    s.advance([entry(t5=0.5, t0=0.3, t6=0.2)])
    s.advance([entry(t6=0.5, t7=0.3, t8=0.2), entry(t8=0.5, t9=0.5)])
    assert s.done
    best = s.best()
    assert [b.token_ids for b in best] == [[5, 6], []]
    assert [s.score(b) for b in best] == pytest.approx([math.log(0.25) / 6, math.log(0.3) / 4])
    assert [b.finish_reason for b in best] == ["length", "stop"]
    # length_penalty 0 ranks by cumulative logprob alone: the short beam first
    s.length_penalty = 0.0
    assert [b.token_ids for b in s.best()] == [[], [5, 6]]


def test_a_kept_end_token_is_not_counted_in_the_length():
    s = search(width=1, max_tokens=1, include_stop_str_in_output=True)
    s.advance([entry(t0=0.5, t5=0.5)])
    done = s.finished[0]
    assert done.token_ids == [EOS] and done.ended_by_token
    assert s.score(done) == pytest.approx(math.log(0.5) / 4)


def test_the_search_ends_when_no_beam_is_left():
    s = search(width=1, max_tokens=5)
    s.advance([{EOS: Logprob(EOS, 0.0, 1)}])     # a distribution with one token, the end: no live beam
    assert s.done and s.steps == 1
    assert [(b.token_ids, b.finish_reason) for b in s.best()] == [([], "stop")]


@pytest.mark.parametrize("field, value", [
    ("stop", ["x"]), ("bad_words", ["x"]), ("logit_bias", {1: 1.0}), ("presence_penalty", 0.5),
    ("repetition_penalty", 1.1), ("allowed_token_ids", [1]), ("thinking_token_budget", 4),
])
def test_fields_beam_search_would_ignore_are_refused(field, value):
    with pytest.raises(ParamError, match=f"{field} is not supported with beam search") as e:
        SamplingParams(use_beam_search=True, **{field: value})
    assert e.value.param == field


def test_the_beam_width_is_bounded_by_the_logprobs_it_needs():
    SamplingParams(use_beam_search=True, n=MAX_BEAM_WIDTH)
    with pytest.raises(ParamError, match="up to") as e:
        SamplingParams(use_beam_search=True, n=MAX_BEAM_WIDTH + 1)
    assert e.value.param == "n"
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(use_beam_search=True, length_penalty=math.nan)
