"""Sampler tests on hand-built logits: every transform against a hand-computed expectation."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import pytest
import torch

from sluice.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_suppression,
    apply_top_k_top_p,
    token_counts,
)
from sluice.sampling_params import SamplingParams

# Chi-square critical values at significance 0.001, by degrees of freedom.
_CHI2_CRIT_001 = {3: 16.266, 4: 18.467, 5: 20.515, 7: 24.322}


def row(
    params: Optional[SamplingParams] = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    seed: Optional[int] = None,
    suppress: Sequence[int] = (),
) -> SamplingRow:
    params = params or SamplingParams()
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, list(prompt), list(output), gen, list(suppress))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(sampler: Sampler, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100).to(dtype)
    before = logits.clone()
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(8)]
    out = sampler(logits, rows)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None
    # the slow path (logprobs asked) agrees with the fast path, and the input is left alone
    rows = [row(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(8)]
    assert torch.equal(sampler(logits, rows).token_ids, logits.argmax(-1))
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy(sampler: Sampler) -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 64)
    rows = [row(SamplingParams(temperature=1.5, top_k=1, logprobs=1)) for _ in range(16)]
    assert torch.equal(sampler(logits, rows).token_ids, logits.argmax(-1))
    # the filter itself, with sampling left on: only the top token survives
    filtered = logits.clone()
    apply_top_k_top_p(filtered, torch.ones(16, dtype=torch.long), torch.ones(16))
    assert torch.equal(torch.isfinite(filtered).sum(-1), torch.ones(16, dtype=torch.long))
    assert torch.equal(filtered.argmax(-1), logits.argmax(-1))


def test_tiny_top_p_equals_greedy(sampler: Sampler) -> None:
    torch.manual_seed(2)
    logits = torch.randn(32, 200) * 3
    rows = [row(SamplingParams(temperature=1.0, top_p=1e-6)) for _ in range(32)]
    for _ in range(3):
        assert torch.equal(sampler(logits, rows).token_ids, logits.argmax(-1))


def test_top_k_top_p_masks_by_hand() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 3)
    logits = probs.log()
    top_k = torch.tensor([4, 2, 4])
    top_p = torch.tensor([0.5, 1.0, 1.0])
    apply_top_k_top_p(logits, top_k, top_p)
    kept = torch.isfinite(logits)
    assert kept.tolist() == [
        [False, True, False, True],   # top_p 0.5: 0.4 + 0.3 is the smallest set reaching 0.5
        [False, True, False, True],   # top_k 2
        [True, True, True, True],     # both off
    ]
    assert torch.allclose(logits[kept], probs.log()[kept])


def test_top_k_sampling_stays_in_top_k(sampler: Sampler) -> None:
    torch.manual_seed(3)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.5, -1.0]]).repeat(400, 1)
    out = sampler(logits, [row(SamplingParams(temperature=1.0, top_k=3)) for _ in range(400)])
    assert set(out.token_ids.tolist()) == {2, 3, 4}


def test_min_p_masks(sampler: Sampler) -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    masked = probs.clone()
    apply_min_p(masked, torch.tensor([0.25]))  # threshold 0.125
    assert torch.equal(masked, torch.tensor([[0.5, 0.3, 0.15, 0.0]]))

    torch.manual_seed(4)
    logits = probs.log().repeat(2000, 1)
    out = sampler(logits, [row(SamplingParams(temperature=1.0, min_p=0.25)) for _ in range(2000)])
    counts = torch.bincount(out.token_ids, minlength=4).float()
    assert counts[3] == 0
    kept = torch.tensor([0.5, 0.3, 0.15]) / 0.95
    assert chi_square(counts[:3], kept) < _CHI2_CRIT_001[3]


def test_repetition_penalty_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]])
    rows = [
        row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1, 2]),
        row(SamplingParams(), prompt=[0], output=[1, 1, 2]),  # penalty off: untouched
    ]
    apply_penalties(logits, rows)
    assert logits.tolist() == [[1.0, -2.0, 0.25, -0.5, 1.0], [2.0, -1.0, 0.5, -0.5, 1.0]]


def test_frequency_and_presence_penalties_by_hand() -> None:
    logits = torch.zeros(3, 5)
    out_ids = [1, 1, 1, 3, 4, 4]  # counts: token1 x3, token3 x1, token4 x2
    rows = [
        row(SamplingParams(frequency_penalty=0.5), prompt=[0, 2], output=out_ids),
        row(SamplingParams(presence_penalty=1.5), prompt=[0, 2], output=out_ids),
        row(SamplingParams(frequency_penalty=-0.5, presence_penalty=0.25), prompt=[0], output=out_ids),
    ]
    apply_penalties(logits, rows)
    assert logits.tolist() == [
        [0.0, -1.5, 0.0, -0.5, -1.0],        # prompt tokens are not penalised
        [0.0, -1.5, 0.0, -1.5, -1.5],
        [0.0, 1.25, 0.0, 0.25, 0.75],        # -(-0.5 * count) - 0.25
    ]


def test_penalties_change_greedy_choice(sampler: Sampler) -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, -4.0]] * 3)
    rows = [
        row(SamplingParams(temperature=0.0, repetition_penalty=1.6), prompt=[0]),  # 3/1.6 < 2
        row(SamplingParams(temperature=0.0, frequency_penalty=0.4), output=[0, 0, 0]),  # 3-1.2 < 2
        row(SamplingParams(temperature=0.0, presence_penalty=0.9), output=[0, 1]),  # 2.1, 1.1 vs 1
    ]
    assert sampler(logits, rows).token_ids.tolist() == [1, 1, 0]


def test_token_counts_scatter() -> None:
    counts = token_counts([[1, 1, 2], [], [0, 2, 2, 2]], 3, 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 1, 0], [0, 0, 0, 0], [1, 0, 3, 0]]


def test_suppression(sampler: Sampler) -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 1.0]] * 500)
    probe = logits[:2].clone()
    apply_suppression(probe, [row(suppress=[0, 99]), row()])  # out-of-vocab ids are ignored
    assert probe[0].tolist() == [float("-inf"), 4.0, 0.0, 1.0] and probe[1].tolist() == [5.0, 4.0, 0.0, 1.0]

    greedy = sampler(logits[:1], [row(SamplingParams(temperature=0.0), suppress=[0])])
    assert greedy.token_ids.tolist() == [1]
    torch.manual_seed(5)
    rows = [row(SamplingParams(temperature=2.0), suppress=[0, 1]) for _ in range(500)]
    sampled = sampler(logits, rows).token_ids
    assert not torch.isin(sampled, torch.tensor([0, 1])).any()
    assert set(sampled.tolist()) == {2, 3}


def test_seeded_rows_independent_of_batch(sampler: Sampler) -> None:
    torch.manual_seed(6)
    steps, vocab = 12, 50
    step_logits = [torch.randn(vocab) * 2 for _ in range(steps)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, min_p=0.01, seed=1234)

    def run(batch_builder) -> list[int]:
        target = row(params, seed=1234)
        tokens = []
        for t in range(steps):
            rows, logits, pos = batch_builder(target, step_logits[t], t)
            tokens.append(sampler(logits, rows).token_ids[pos].item())
            target.output_token_ids.append(tokens[-1])
        return tokens

    def alone(target, lg, t):
        return [target], lg.unsqueeze(0), 0

    def crowded(target, lg, t):
        others = [
            row(SamplingParams(temperature=1.3), output=[1, 2]),
            row(SamplingParams(temperature=0.0, logprobs=3)),
            row(SamplingParams(temperature=0.7, top_k=5, presence_penalty=1.0), output=[3], seed=99 + t),
            row(SamplingParams(temperature=1.0, seed=1234), seed=1234),  # same seed, own generator
        ]
        pos = t % (len(others) + 1)
        rows = others[:pos] + [target] + others[pos:]
        logits = torch.randn(len(rows), vocab)
        logits[pos] = lg
        return rows, logits, pos

    expected = run(alone)
    assert run(crowded) == expected
    assert run(alone) == expected
    assert len(set(expected)) > 1  # it really sampled


def test_unseeded_distribution_matches_softmax(sampler: Sampler) -> None:
    torch.manual_seed(7)
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.5])
    temperature = 0.8
    logits = base.repeat(4000, 1)
    out = sampler(logits, [row(SamplingParams(temperature=temperature)) for _ in range(4000)])
    counts = torch.bincount(out.token_ids, minlength=8).float()
    assert chi_square(counts, torch.softmax(base / temperature, -1)) < _CHI2_CRIT_001[7]
    # and a wrong temperature is rejected by the same statistic
    assert chi_square(counts, torch.softmax(base, -1)) > _CHI2_CRIT_001[7]


def test_seeded_distribution_matches_softmax(sampler: Sampler) -> None:
    base = torch.tensor([0.3, -0.2, 1.1, 0.0, 0.6, -1.0])
    logits = base.repeat(3000, 1)
    rows = [row(SamplingParams(temperature=1.0, seed=s), seed=s) for s in range(3000)]
    counts = torch.bincount(sampler(logits, rows).token_ids, minlength=6).float()
    assert chi_square(counts, torch.softmax(base, -1)) < _CHI2_CRIT_001[5]


def test_logprobs_values_and_ranks(sampler: Sampler) -> None:
    torch.manual_seed(8)
    logits = torch.randn(5, 40).to(torch.bfloat16)
    ref = torch.log_softmax(logits.float(), -1)
    rows = [
        row(SamplingParams(temperature=1.0, logprobs=5)),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5), output=[1, 2, 3]),
        row(SamplingParams(temperature=1.0)),
        row(SamplingParams(temperature=2.0, logprobs=20), seed=3),
    ]
    out = sampler(logits, rows)
    assert out.logprobs is not None and out.logprobs[3] is None
    for i, r in enumerate(rows):
        entry = out.logprobs[i]
        if r.params.logprobs is None:
            continue
        assert entry is not None
        tok = int(out.token_ids[i])
        first = next(iter(entry.values()))
        assert first.token_id == tok  # the sampled token comes first
        assert math.isclose(first.logprob, float(ref[i, tok]), abs_tol=1e-6)
        assert first.rank == int((ref[i] > ref[i, tok]).sum()) + 1
        top_vals, top_ids = ref[i].topk(r.params.logprobs)
        for rank, (tid, val) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            assert tid in entry
            assert math.isclose(entry[tid].logprob, val, abs_tol=1e-6)
            if tid != tok:
                assert entry[tid].rank == rank
        assert set(entry) == set(top_ids.tolist()) | {tok}
    # greedy row: the chosen token is rank 1
    assert next(iter(out.logprobs[1].values())).rank == 1


def test_mixed_batch(sampler: Sampler) -> None:
    torch.manual_seed(9)
    vocab = 30
    logits = torch.randn(7, vocab).to(torch.float16)
    lf = logits.float()
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, repetition_penalty=1.3), prompt=[int(lf[1].argmax())]),
        row(SamplingParams(temperature=1.0, top_k=4)),
        row(SamplingParams(temperature=0.7, top_p=0.5, seed=5), seed=5),
        row(SamplingParams(temperature=1.0, min_p=0.5, logprobs=2)),
        row(SamplingParams(temperature=1.0), suppress=list(range(vocab - 1))),
        row(SamplingParams(temperature=1.2, frequency_penalty=2.0, presence_penalty=2.0), output=[7] * 10),
    ]
    out = sampler(logits, rows)
    toks = out.token_ids.tolist()
    assert out.token_ids.shape == (7,) and out.token_ids.dtype == torch.int64
    assert toks[0] == int(lf[0].argmax())
    expected1 = lf[1].clone()
    apply_penalties(expected1.unsqueeze(0), [rows[1]])
    assert toks[1] == int(expected1.argmax())
    assert toks[2] in lf[2].topk(4).indices.tolist()
    p3_sorted, p3_order = torch.softmax(lf[3] / 0.7, -1).sort(descending=True)
    nucleus = p3_order[: int((p3_sorted.cumsum(0) < 0.5).sum()) + 1]  # smallest set reaching 0.5
    assert toks[3] in nucleus.tolist()
    p4 = torch.softmax(lf[4], -1)
    assert p4[toks[4]] >= 0.5 * p4.max()
    assert toks[5] == vocab - 1
    assert toks[6] != 7
    assert out.logprobs is not None
    assert [e is not None for e in out.logprobs] == [False, False, False, False, True, False, False]


def test_mixed_batch_rows_sample_as_they_would_alone(sampler: Sampler) -> None:
    """Plain greedy rows take the fast argmax on their own subset, the rest the general path on
    theirs: each row's token (and logprobs) equals what the row gets in a batch of one."""
    torch.manual_seed(1)
    logits = torch.randn(6, 50).to(torch.bfloat16)
    mask = torch.zeros(2, dtype=torch.int32)
    mask[1] = 1 << 3                                  # only token 35
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=2)),
        row(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams(temperature=0.0), [], [], None, (), mask),
        row(SamplingParams(temperature=0.8, seed=5), seed=5),
        row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[int(logits[5].float().argmax())]),
    ]
    out = sampler(logits, rows)
    assert out.token_ids[3].item() == 35
    for i, r in enumerate(rows):
        if r.generator is not None:
            r = row(SamplingParams(temperature=0.8, seed=5), seed=5)   # a fresh generator, same seed
        alone = sampler(logits[i:i + 1], [r])
        assert out.token_ids[i].item() == alone.token_ids[0].item(), i
        got = out.logprobs[i] if out.logprobs is not None else None
        assert got == (alone.logprobs[0] if alone.logprobs is not None else None), i
    assert out.logprobs is not None and [lp is not None for lp in out.logprobs] == [False, True] + [False] * 4


def test_logit_bias_and_allowed_token_ids(sampler: Sampler) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    biased = row(SamplingParams(temperature=0.0, logit_bias={0: 5.0, 3: -1.5}))
    out = sampler(logits, [biased, row(SamplingParams(temperature=0.0))])
    assert out.token_ids.tolist() == [0, 3]           # 0 + 5 beats 3 - 1.5; the other row is unbiased
    assert sampler(logits[:1], [row(SamplingParams(temperature=0.0, logit_bias={2: 0.5, 3: -0.6}))]
                   ).token_ids.tolist() == [2]         # 2.5 > 2.4
    allowed = row(SamplingParams(temperature=0.0, allowed_token_ids=[0, 1]))
    assert sampler(logits[:1], [allowed]).token_ids.tolist() == [1]
    draws = {sampler(logits[:1], [row(SamplingParams(temperature=1.0, allowed_token_ids=[0, 2]))]).token_ids.item()
             for _ in range(100)}
    assert draws == {0, 2}
    # logprobs stay those of the raw distribution (as penalties leave them)
    lp = sampler(logits[:1], [row(SamplingParams(temperature=0.0, logit_bias={0: 5.0}, logprobs=0))]).logprobs[0]
    assert lp[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())


@pytest.mark.parametrize("kwargs", [{"logit_bias": {1: 101.0}}, {"logit_bias": {-1: 1.0}},
                                    {"allowed_token_ids": []}, {"allowed_token_ids": [-2]}])
def test_bad_logit_bias_and_allowed_ids_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_words_ban_a_sequence_s_last_token_after_the_rest_of_it() -> None:
    """vLLM's rule: a one-token word is banned always; a longer one's last token only where the
    output (then the drafts before the position) ends with the rest of it; the prompt never counts."""
    from sluice.engine.bad_words import BadWords
    from sluice.engine.model_runner import ModelRunner
    from sluice.engine.request import Request

    bw = BadWords([[1, 2, 3], [7], [5, 6]])
    assert bw.banned([]) == (7,)
    assert bw.banned([9, 1]) == (7,) and bw.banned([9, 1, 2]) == (3, 7)
    assert bw.banned([9, 1], [2]) == (3, 7) and bw.banned([], [1, 2]) == (3, 7) and bw.banned([1, 2], [4]) == (7,)
    assert bw.banned([2, 5]) == (7, 6) and bw.banned([5], [8]) == (7,)
    req = Request("r", [1, 2], SamplingParams(temperature=0.0, max_tokens=8), 8, 0.0, bad_words=bw)
    assert req.banned_token_ids() == (7,)                       # the prompt's [1, 2] does not count
    req.append_output_token(1)
    rows = ModelRunner._rows(req, [2, 3, 5])                    # verifying drafts 2, 3, 5 after output [1]
    assert [tuple(r.suppress_token_ids) for r in rows] == [(7,), (3, 7), (7,), (7, 6)]
    greedy = Sampler()(torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.0, 0.0, 0.0, 8.0]]), rows[1:2])
    assert greedy.token_ids.tolist() == [2]                     # 3 and 7 banned: the next best


def test_bad_words_params_are_checked() -> None:
    assert SamplingParams(bad_words="word").bad_words == ["word"]
    for bad in ([""], ["  "], [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)


def test_logprob_token_ids_give_the_named_tokens_instead_of_the_top(sampler: Sampler) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 3.0, -1.0]])
    lp = torch.log_softmax(logits, dim=-1)[0]
    params = SamplingParams(temperature=0.0, logprobs=2, logprob_token_ids=[4, 1])
    [entry] = sampler(logits, [row(params)]).logprobs
    assert list(entry) == [3, 4, 1]                                   # the sampled token, then the named
    assert [(e.rank, round(e.logprob, 5)) for e in entry.values()] == [
        (1, round(float(lp[3]), 5)), (5, round(float(lp[4]), 5)), (3, round(float(lp[1]), 5))]
    with pytest.raises(ValueError, match="needs logprobs"):
        SamplingParams(logprob_token_ids=[1])
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprobs=0, logprob_token_ids=[])


def test_a_forced_row_yields_its_token_with_the_raw_logprobs(sampler: Sampler) -> None:
    """thinking_token_budget's forced end: the row yields its forced token whatever it would have
    sampled (greedy, random, penalised, masked away), its logprob the raw distribution's; rows
    beside it sample as they would alone."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    lp = torch.log_softmax(logits, dim=-1)
    forced = int(logits[0].argmin())
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.8, logprobs=0),
              SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0)]
    rows = [row(p, output=[forced]) for p in params]
    rows[0].suppress_token_ids = [forced]                  # suppressed or not, it is what comes out
    rows[0].forced_token_id = forced
    rows[1].forced_token_id = 7
    rows[2].forced_token_id = 3
    out = sampler(logits, rows)
    assert out.token_ids.tolist()[:3] == [forced, 7, 3]
    assert out.token_ids[3] == logits[3].argmax()
    assert out.logprobs[0][forced].logprob == pytest.approx(float(lp[0, forced]), abs=1e-5)
    assert out.logprobs[0][forced].rank == 50              # the least likely token, forced
    assert out.logprobs[1][7].logprob == pytest.approx(float(lp[1, 7]), abs=1e-5)
    alone = sampler(logits[3:], [row(params[3])])
    assert out.token_ids[3] == alone.token_ids[0]
