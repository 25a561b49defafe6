"""SmolLM2-135M-Instruct (Q4_1 GGUF) through the real engine against transformers.

transformers dequantizes the same GGUF with its own loader and is the reference: its greedy
continuation (`generate(do_sample=False)`, each prompt alone) must equal sluice's token for
token in float32, whether a prompt runs alone, in a mixed batch, after a prefix-cache hit, in
64-token prefill chunks interleaved with decodes, or after being preempted and recomputed.

float32 logprobs: within 5e-4 of transformers' log-softmax. The two stacks dequantize the
same blocks and run the same float32 math in a different order (fused projections, paged
SDPA, rotary from a table); through 30 layers that moves logprobs by ~3e-5 (measured), while
a real defect (a wrong rope, a misplaced KV slot, a stale cache block) moves them by O(0.1-1).

bfloat16: every matmul rounds to 8 mantissa bits, and the logits themselves are bf16, so
near the top of the distribution (logits of 8-32) they move in steps of 0.0625-0.125 and exact
ties are common. Measured on these prompts: either stack's bf16 next-token logprobs sit
0.04-0.23 nats from float32; sluice-bf16 and transformers-bf16 each fork from the float32
greedy path on about a third of prompts (at different places), and from each other at gaps of
0 (exact ties), 0.125 and 0.44 nats. The criterion:
(1) first generated token: sluice's top logprobs within 0.5 nats of transformers-bf16's;
(2) sluice-bf16 no less accurate than transformers-bf16, both measured at the first token
    against transformers-fp32 (mean over prompts; 1.5x slack, as 9 prompts are a noisy mean);
(3) every continuation equals transformers-bf16's up to a fork where transformers itself sees
    a near-tie: sluice's pick at most 0.75 nats (a few bf16 ulps of a logit) below its own;
(4) at least 6 of the 9 continuations identical end to end, where a fork at an exact bf16 tie
    in transformers' logits (its pick is then just the lower token id) counts as identical.
A real bf16 defect (low-precision norm or rotary, a cache of the wrong dtype) fails (1)/(2)
by a wide margin; one that only shifts some logits by a nat or more fails (3).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import jsonschema
import pytest
import torch

from hf_reference import hf_model_fp32
from sluice.engine import llm_engine
from sluice.engine.bad_words import bad_words_token_ids
from sluice.engine.errors import RequestRejected
from sluice.llm import LLM
from sluice.model import gguf_loader
from sluice.engine.structured_output import allowed_tokens, grammar_text
from sluice.sampling_params import (
    STREAM_FINAL_ONLY, RepetitionDetectionParams, SamplingParams, StructuredOutputsParams,
)
from test_stop_rules import reference_repeats

try:
    from sluice.model.default import ensure_default_model
    MODEL = ensure_default_model()
except Exception:  # noqa: BLE001 -- the default-model helper is optional here
    MODEL = Path("/root/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf")

pytestmark = pytest.mark.skipif(not Path(MODEL).is_file(), reason=f"{MODEL} is not available")

MAX_TOKENS = 24
FP32_LOGPROB_ATOL = 5e-4
BF16_LOGPROB_ATOL = 0.5
BF16_ERROR_SLACK = 1.5
BF16_NEAR_TIE = 0.75
BF16_MIN_EXACT = 6

DOC = (
    "The lighthouse on Gull Island was built in 1871 by the engineer Margaret Ellison, who designed "
    "its spiral stair of cast iron so that it could be carried to the island in pieces by rowing boat. "
    "For sixty years the light was kept by the Harlow family: first Thomas Harlow, a retired fisherman, "
    "then his daughter Ada, who kept a logbook of every ship that passed, and finally Ada's son Peter. "
    "In the winter of 1923 a storm tore the lantern glass from its frame, and Peter kept a paraffin lamp "
    "burning in the gallery for nine nights until a supply ship could reach the island with new panes. "
    "The light was converted to electricity in 1953, and the last keeper left in 1987 when the station "
    "became fully automatic. Today the keeper's cottage is a small museum. Visitors can read Ada's "
    "logbooks, which record more than twelve thousand ships, climb the ninety-one steps of Ellison's "
    "stair, and look out over the reef that wrecked the steamer Corinth in 1868, the disaster that "
    "persuaded the harbour board to build the light in the first place. The island is reached by a "
    "ferry that runs twice a day in summer and not at all in winter, when the crossing is too rough."
)
_DOC_SYSTEM = "You answer questions about this document.\n\n" + DOC


def _chat(*turns: str, system: str | None = None) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    roles = ("user", "assistant")
    return msgs + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


FRANCE = _chat("What is the capital of France?")
# Chat conversations (templated) and raw text prompts of 1 to 300 tokens.
PROMPTS: dict[str, list[dict] | str] = {
    "france": FRANCE,
    "tips": _chat("Give me three tips for staying focused while studying.", system="You are a concise assistant."),
    "multi_turn": _chat("Hi! Can you help me with some math?", "Of course! What do you need?", "What is 12 times 7?"),
    "long": _chat("Summarize the document in one sentence.", system=_DOC_SYSTEM),
    "fox": "The quick brown fox",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "story": "Once upon a time, in a small village by the sea, there lived",
    "numbers": "1, 2, 3, 5, 8, 13,",
    "hello": "Hello",  # one token: its prefill is a single-token query
}
# Later questions on the same document share LONG's ~300-token prefix.
PREFIX_FOLLOWUPS = [_chat("Who designed the lighthouse?", system=_DOC_SYSTEM),
                    _chat("What happened in the winter of 1923?", system=_DOC_SYSTEM)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The CPUs are shared: one intra-op thread avoids OpenMP spin-waits on a loaded machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def make_llm():
    """`make_llm(**LLM kwargs)`: engines with their own caches and schedulers that share one
    loaded copy of the weights per dtype (the model holds no per-engine state)."""
    loaded, opened = {}, {}
    real_load, real_read = llm_engine.load_model, gguf_loader.read_gguf

    def load_once(path, cfg, dtype, backend, huge_pages=False, weight_format="auto"):
        key = (str(path), dtype, type(backend), huge_pages, weight_format)
        if key not in loaded:
            loaded[key] = real_load(path, cfg, dtype, backend, huge_pages=huge_pages, weight_format=weight_format)
        return loaded[key]

    def read_once(path):  # the config, the tokenizer and the weights each open the file
        if str(path) not in opened:
            opened[str(path)] = real_read(path)
        return opened[str(path)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "load_model", load_once)
        mp.setattr(gguf_loader, "read_gguf", read_once)
        yield lambda **kw: LLM(str(MODEL), **{"max_model_len": 512, **kw})


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    """float32, no prefix caching: each prompt computed from scratch."""
    return make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False)


@dataclass
class Reference:
    model: torch.nn.Module
    cache: dict = field(default_factory=dict)

    def __call__(self, ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy continuation of `ids` alone and its per-step log-softmax
        [steps, vocab], memoized."""
        key = tuple(ids)
        if key not in self.cache:
            t = torch.tensor([ids])
            with torch.no_grad():
                out = self.model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                          max_new_tokens=MAX_TOKENS, output_logits=True,
                                          return_dict_in_generate=True)
            self.cache[key] = (out.sequences[0, len(ids):].tolist(),
                               torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
        return self.cache[key]

    def first_step(self, ids: list[int]) -> torch.Tensor:
        """Log-softmax [vocab] of the token after `ids` (from the memo when it has it)."""
        if tuple(ids) in self.cache:
            return self.cache[tuple(ids)][1][0]
        with torch.no_grad():
            return torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


@pytest.fixture(scope="module")
def hf_fp32():
    return hf_model_fp32(MODEL)


@pytest.fixture(scope="module")
def ref(hf_fp32) -> Reference:
    return Reference(hf_fp32)


def encode(llm: LLM, prompt) -> list[int]:
    if isinstance(prompt, str):
        return llm.tokenizer.encode(prompt)
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(prompt, add_generation_prompt=True),
                                add_special_tokens=False)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> dict[str, list[int]]:
    return {name: encode(llm, p) for name, p in PROMPTS.items()}


def assert_same_as_reference(ref: Reference, ids: list[int], out, name: str = "") -> None:
    expected, ref_lp = ref(ids)
    comp = out.outputs[0]
    assert comp.token_ids == expected, f"{name}: sluice {comp.token_ids} != transformers {expected}"
    if comp.logprobs is not None:
        for step, lps in enumerate(comp.logprobs):
            tids = list(lps)
            got = torch.tensor([lps[t].logprob for t in tids])
            torch.testing.assert_close(got, ref_lp[step, tids], atol=FP32_LOGPROB_ATOL, rtol=0,
                                       msg=lambda m, step=step: f"{name} step {step}: {m}")


def assert_drained(llm: LLM) -> None:
    llm.engine.scheduler.check_invariants()
    assert llm.engine.stats().kv_blocks_used == 0


# --- float32: token for token --------------------------------------------------------------
def test_prompt_mix(prompt_ids):
    lens = {n: len(ids) for n, ids in prompt_ids.items()}
    assert lens["hello"] == 1 and lens["long"] >= 300, lens


def test_capital_of_france(llm, ref):
    out = llm.chat(FRANCE, GREEDY)
    assert "Paris" in out.outputs[0].text
    assert_same_as_reference(ref, encode(llm, FRANCE), out, "france")


def test_offline_chat_renders_tools_as_the_server_does(llm):
    """`LLM.chat(..., tools=)`: SmolLM2's template ignores tools, so their signatures go into the
    system message (sluice/server/tool_calls.py), in place of the template's default one."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    plain = llm.tokenizer.decode(llm.chat(FRANCE, one).prompt_token_ids, skip_special_tokens=False)
    with_tools = llm.tokenizer.decode(llm.chat(FRANCE, one, tools=tools).prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" not in plain and "named SmolLM" in plain
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in with_tools
    assert "named SmolLM" not in with_tools and with_tools.endswith(plain[plain.index("<|im_start|>user"):])
    assert_drained(llm)


def test_each_prompt_alone(llm, ref, prompt_ids):
    for name, ids in prompt_ids.items():
        [out] = llm.generate([ids], GREEDY)
        assert_same_as_reference(ref, ids, out, name)
    assert_drained(llm)


def test_mixed_batch_with_logprobs(llm, ref, prompt_ids):
    names = list(prompt_ids)
    outs = llm.generate([prompt_ids[n] for n in names], GREEDY_LP)
    for name, out in zip(names, outs):
        assert_same_as_reference(ref, prompt_ids[name], out, name)
    assert_drained(llm)


def test_prefix_cache_hit(make_llm, ref, prompt_ids):
    cached = make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=True)
    followups = [encode(cached, p) for p in PREFIX_FOLLOWUPS]
    shared = next(i for i, (a, b) in enumerate(zip(prompt_ids["long"], followups[0])) if a != b)
    assert shared >= 280
    [first] = cached.generate([prompt_ids["long"]], GREEDY)
    assert_same_as_reference(ref, prompt_ids["long"], first, "long")
    outs = cached.generate(followups, GREEDY)
    for i, (ids, out) in enumerate(zip(followups, outs)):
        assert out.num_cached_tokens >= shared - cached.engine.config.cache.block_size, out.num_cached_tokens
        assert_same_as_reference(ref, ids, out, f"followup {i}")
    assert_drained(cached)


def test_chunked_prefill_interleaved_with_decodes(make_llm, ref, prompt_ids):
    chunked = make_llm(dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=64,
                       enable_prefix_caching=False)
    steps = []
    schedule = chunked.engine.scheduler.schedule

    def spy():
        out = schedule()
        steps.append([(r.num_output_tokens > 0, r.num_computed_tokens, n, r.num_tokens) for r, n in out.scheduled])
        return out

    chunked.engine.scheduler.schedule = spy
    names = list(prompt_ids)
    outs = chunked.generate([prompt_ids[n] for n in names], GREEDY)
    for name, out in zip(names, outs):
        assert_same_as_reference(ref, prompt_ids[name], out, name)
    mixed = [s for s in steps
             if any(dec for dec, *_ in s) and any(not dec and c + n < total for dec, c, n, total in s)]
    assert mixed, "some step should run decodes next to an unfinished prefill chunk"
    assert any(not dec and c > 0 for s in steps for dec, c, n, _ in s), "some prefill should resume mid-prompt"
    assert_drained(chunked)


def test_preemption(make_llm, ref, prompt_ids):
    # 448 tokens of cache (28 blocks) for ~700 tokens of prompts (491) and outputs.
    tight = make_llm(dtype="float32", kv_cache_tokens=448, max_model_len=448, enable_prefix_caching=True)
    names = list(prompt_ids)
    outs = tight.generate([prompt_ids[n] for n in names], GREEDY)
    assert tight.engine.stats().num_preemptions > 0
    for name, out in zip(names, outs):
        assert_same_as_reference(ref, prompt_ids[name], out, name)
    assert_drained(tight)


def assert_prompt_logprobs(ref: Reference, ids: list[int], prompt_lps, k: int, name: str) -> None:
    """Every prompt token's logprob, its rank and the top k against transformers' log-softmax of
    the whole prompt in one forward."""
    with torch.no_grad():
        lp = torch.log_softmax(ref.model(torch.tensor([ids])).logits[0].float(), dim=-1)   # [P, vocab]
    assert prompt_lps is not None and len(prompt_lps) == len(ids), name
    assert prompt_lps[0] is None, name
    for t in range(1, len(ids)):
        entry, row, tok = prompt_lps[t], lp[t - 1], ids[t]
        assert tok in entry, f"{name} token {t}"
        assert abs(entry[tok].logprob - row[tok].item()) <= FP32_LOGPROB_ATOL, f"{name} token {t}"
        v = row[tok].item()   # rank: 1 + how many score higher (ties within the tolerance either way)
        lo, hi = int((row > v + FP32_LOGPROB_ATOL).sum()) + 1, int((row > v - FP32_LOGPROB_ATOL).sum()) + 1
        assert lo <= entry[tok].rank <= hi, f"{name} token {t}: rank {entry[tok].rank} not in [{lo}, {hi}]"
        top = sorted((e for e in entry.values() if e.rank <= k), key=lambda e: e.rank)
        assert len(entry) in (k, k + 1) and [e.rank for e in top] == list(range(1, k + 1)), f"{name} token {t}"
        got = torch.tensor([e.logprob for e in top])
        torch.testing.assert_close(got, row.topk(k).values, atol=FP32_LOGPROB_ATOL, rtol=0,
                                   msg=lambda m: f"{name} token {t}: {m}")


def test_prompt_logprobs(make_llm, ref, prompt_ids):
    """`prompt_logprobs` (the completions API's echo with logprobs) match transformers at every
    position: prompts computed in 160-token chunks (the 300-token prompt in two, each scored in
    128-row slices), next to decodes, for both samples of n = 2, and for a prompt the prefix
    cache holds, which must be computed again (hits stop where the logprobs reach); the greedy
    continuations are unchanged."""
    llm = make_llm(dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=160, enable_prefix_caching=True)
    names = ["long", "france", "fox", "hello"]
    [warm] = llm.generate([prompt_ids["long"]], GREEDY)          # the long prompt is now cached
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=3, n=2)
    outs = llm.generate([prompt_ids[n] for n in names], params)
    for name, out in zip(names, outs):
        ids = prompt_ids[name]
        assert out.num_cached_tokens == 0, (name, out.num_cached_tokens)
        assert_prompt_logprobs(ref, ids, out.prompt_logprobs, 3, name)
        for comp in out.outputs:
            assert comp.token_ids == ref(ids)[0], name
    # Without prompt logprobs the same prompt is a cache hit again.
    [again] = llm.generate([prompt_ids["long"]], GREEDY)
    assert again.prompt_logprobs is None and again.num_cached_tokens >= len(prompt_ids["long"]) - 16
    assert_drained(llm)


def test_prompt_logprobs_through_preemption(make_llm, ref, prompt_ids):
    """Preempted and recomputed requests still give every prompt position exactly once."""
    tight = make_llm(dtype="float32", kv_cache_tokens=448, max_model_len=448, max_num_batched_tokens=64,
                     enable_prefix_caching=True)
    names = list(prompt_ids)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1)
    outs = tight.generate([prompt_ids[n] for n in names], params)
    assert tight.engine.stats().num_preemptions > 0
    for name, out in zip(names, outs):
        assert_prompt_logprobs(ref, prompt_ids[name], out.prompt_logprobs, 1, name)
        assert out.outputs[0].token_ids == ref(prompt_ids[name])[0], name
    assert_drained(tight)


# --- bfloat16: the same up to near-ties ----------------------------------------------------
def test_bfloat16_matches_transformers_bfloat16(make_llm, hf_fp32, ref, prompt_ids):
    bf16 = make_llm(dtype="bfloat16", kv_cache_tokens=4096, enable_prefix_caching=False)
    ref16 = Reference(copy.deepcopy(hf_fp32).to(torch.bfloat16))
    names = list(prompt_ids)
    outs = bf16.generate([prompt_ids[n] for n in names], GREEDY_LP)
    exact, report, err_sluice, err_hf = 0, [], [], []
    for name, out in zip(names, outs):
        ids, comp = prompt_ids[name], out.outputs[0]
        expected, lp16 = ref16(ids)
        lp32 = ref.first_step(ids)
        tids = list(comp.logprobs[0])
        got = torch.tensor([comp.logprobs[0][t].logprob for t in tids])
        pair = (got - lp16[0, tids]).abs().max().item()
        err_sluice.append((got - lp32[tids]).abs().max().item())
        err_hf.append((lp16[0, tids] - lp32[tids]).abs().max().item())
        line = f"{name}: |sluice-hf| {pair:.3f}, vs fp32: sluice {err_sluice[-1]:.3f} hf {err_hf[-1]:.3f}"
        assert pair <= BF16_LOGPROB_ATOL, line
        k = next((i for i, (a, b) in enumerate(zip(comp.token_ids, expected)) if a != b), None)
        if k is None:
            assert comp.token_ids == expected, f"{name}: {comp.token_ids} vs {expected}"
            exact += 1
        else:
            gap = (lp16[k, expected[k]] - lp16[k, comp.token_ids[k]]).item()
            line += f"; forks at step {k}, {gap:.3f} nats below transformers' pick"
            assert gap <= BF16_NEAR_TIE, line
            exact += gap == 0.0
        report.append(line)
    mean_sluice, mean_hf = sum(err_sluice) / len(names), sum(err_hf) / len(names)
    print("\n".join(report))  # shown with -rP or on failure
    assert mean_sluice <= BF16_ERROR_SLACK * mean_hf, report
    assert exact >= BF16_MIN_EXACT, report
    assert_drained(bf16)


# --- prompt-lookup speculative decoding ------------------------------------------------------
# min n = 1 drafts often and is often wrong: both the accept and the reject paths run.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _spec_counts(llm: LLM) -> tuple[int, int]:
    st = llm.engine.stats()
    return st.spec_draft_tokens_total, st.spec_accepted_tokens_total


def test_speculative_decoding_matches_reference(make_llm, ref, prompt_ids):
    """Verified drafts leave float32 greedy output and its logprobs exactly as transformers'."""
    spec = make_llm(dtype="float32", kv_cache_tokens=4096, speculative_config=SPEC)
    names = list(prompt_ids)
    outs = spec.generate([prompt_ids[n] for n in names], GREEDY_LP)
    for name, out in zip(names, outs):
        assert_same_as_reference(ref, prompt_ids[name], out, name)
    drafted, accepted = _spec_counts(spec)
    assert 0 < accepted < drafted, (drafted, accepted)
    # and alone, one prompt at a time (a batch of one verifies every step)
    for name in ("numbers", "long", "code"):
        [out] = spec.generate([prompt_ids[name]], GREEDY)
        assert_same_as_reference(ref, prompt_ids[name], out, name)
    assert_drained(spec)


def test_speculative_decoding_under_preemption(make_llm, ref, prompt_ids):
    tight = make_llm(dtype="float32", kv_cache_tokens=448, max_model_len=448, speculative_config=SPEC)
    names = list(prompt_ids)
    outs = tight.generate([prompt_ids[n] for n in names], GREEDY)
    assert tight.engine.stats().num_preemptions > 0 and _spec_counts(tight)[1] > 0
    for name, out in zip(names, outs):
        assert_same_as_reference(ref, prompt_ids[name], out, name)
    assert_drained(tight)


def test_speculative_decoding_stops_where_plain_decoding_does(make_llm, llm, prompt_ids):
    """A stop string inside an accepted run of drafts ends the output at the same place, and
    token-level stops (max_tokens) are not overrun by accepted drafts."""
    spec = make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, speculative_config=SPEC)
    for name in ("numbers", "story", "long"):
        [plain] = llm.generate([prompt_ids[name]], GREEDY)
        text = plain.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 3]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
        [a] = llm.generate([prompt_ids[name]], params)
        [b] = spec.generate([prompt_ids[name]], params)
        assert (b.outputs[0].text, b.outputs[0].finish_reason) == (a.outputs[0].text, "stop"), name
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
        for max_tokens in (2, 5, 7):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            [c] = spec.generate([prompt_ids[name]], params)
            assert c.outputs[0].token_ids == plain.outputs[0].token_ids[:max_tokens], (name, max_tokens)
            assert c.outputs[0].finish_reason == "length"
    assert _spec_counts(spec)[1] > 0
    assert_drained(spec)


def test_bad_words_match_transformers(make_llm, llm, ref, hf_fp32, prompt_ids):
    """bad_words: float32 greedy output token for token as transformers' `bad_words_ids` with the
    sequences sluice derives (a word of the free output alone, then a two-word phrase of it, whose
    second token is banned only right after its first), with and without speculative decoding."""
    spec = make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, speculative_config=SPEC)
    cases = []
    for name in ("france", "story", "numbers", "long"):
        ids = prompt_ids[name]
        free, _ = ref(ids)
        words = [llm.tokenizer.decode([t]).strip() for t in free]

        def bans(span):  # a word whose banned sequences include the free output's tokens at span
            word = llm.tokenizer.decode(free[span])
            return word.strip() and list(free[span]) in bad_words_token_ids(llm.tokenizer, [word])

        single = next(llm.tokenizer.decode(free[k:k + 1]) for k in range(2, len(free)) if bans(slice(k, k + 1)))
        phrase = next(llm.tokenizer.decode(free[j:j + 2]) for j in range(1, len(free) - 1)
                      if words[j] and words[j + 1] and free[j] != ids[-1] and bans(slice(j, j + 2)))
        for bad in ([single], [phrase]):
            seqs = bad_words_token_ids(llm.tokenizer, bad)
            t = torch.tensor([ids])
            with torch.no_grad():
                expected = hf_fp32.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=MAX_TOKENS,
                                            bad_words_ids=seqs)[0, len(ids):].tolist()
            assert expected != free, (name, bad)
            cases.append((name, ids, bad, seqs, expected))
    for engine in (llm, spec):   # every case in one batch
        outs = engine.generate([c[1] for c in cases],
                               [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, bad_words=c[2]) for c in cases])
        for (name, _, bad, seqs, expected), out in zip(cases, outs):
            got = out.outputs[0].token_ids
            assert got == expected[:len(got)] and (len(got) == len(expected) or out.outputs[0].finish_reason == "stop"), (
                name, bad, got, expected)
            assert not any(tuple(got[i:i + len(s)]) == tuple(s) for s in seqs for i in range(len(got))), (name, bad)
    assert _spec_counts(spec)[1] > 0
    assert_drained(spec)


def test_repetition_detection_ends_the_reference_output_where_it_repeats(make_llm, llm, ref, prompt_ids):
    """repetition_detection on real output: sluice's float32 greedy output is transformers' up to
    the first token where that output ends with a pattern of 1-4 tokens repeated twice (checked
    segment by segment), and ends there with finish reason "repetition"; where the reference never
    repeats so, it is the whole reference. With and without speculative decoding."""
    spec = make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            repetition_detection=RepetitionDetectionParams(max_pattern_size=4, min_count=2))
    names = list(prompt_ids)
    for engine in (llm, spec):   # every prompt in one batch
        outs = engine.generate([prompt_ids[n] for n in names], params)
        for name, out in zip(names, outs):
            expected, _ = ref(prompt_ids[name])
            cut = next((k for k in range(1, len(expected) + 1) if reference_repeats(expected[:k], 4, 0, 2)), None)
            o = out.outputs[0]
            if cut is None:
                assert o.token_ids == expected and o.finish_reason != "repetition", name
            else:
                assert (o.token_ids, o.finish_reason, o.stop_reason) == (
                    expected[:cut], "repetition", "repetition_detected"), (name, o.token_ids, expected)
    cut_prompts = [n for n in names if any(reference_repeats(ref(prompt_ids[n])[0][:k], 4, 0, 2)
                                           for k in range(1, MAX_TOKENS + 1))]
    assert len(cut_prompts) >= 2, cut_prompts         # real outputs that repeat, not only clean ones
    assert_drained(llm)
    assert_drained(spec)


THINK_SHOT = [   # few-shot: the model opens and closes a thought of its own
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>Two plus two makes four.</think>The answer is 4."},
    {"role": "user", "content": "What is 3 plus 3?"},
    {"role": "assistant", "content": "<think>Three plus three makes six.</think>The answer is 6."},
    {"role": "user", "content": "What is 5 plus 5?"},
]


def test_thinking_token_budget_cuts_the_reference_thought(make_llm, llm, ref):
    """thinking_token_budget on real output: float32 greedy output with a budget is transformers'
    greedy thought up to the budget, then the forced end (here a transition phrase set by
    `reasoning_config`), then transformers' greedy continuation of all that; a thought that ends
    within its budget is left as it is. Thoughts the prompt opens (its own thought tokens count)
    and thoughts the model opens; with and without speculative decoding (which drafts the forced
    end: every one of its tokens is accepted)."""
    phrase = " Time to answer.</think>"
    engines = [make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, reasoning_parser="glm45",
                        reasoning_config={"reasoning_end_str": phrase}, **kw) for kw in ({}, {"speculative_config": SPEC})]
    tok = llm.tokenizer
    start, end, forced = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>", phrase))
    opened = encode(llm, [{"role": "user", "content": "What is 5 plus 5? Think step by step."}]) + \
        tok.encode("<think>\n", add_special_tokens=False)
    inside = 1                                             # the prompt's "\n" after its start tag
    assert opened[-1 - len(start):-1] == start
    few_shot = encode(llm, THINK_SHOT)
    free, _ = ref(few_shot)
    assert free[:len(start)] == start and end in [free[i:i + len(end)] for i in range(len(free))], free
    thought = next(i for i in range(len(free)) if free[i:i + len(end)] == end) - len(start)
    cases = [(opened, b, max(0, b - inside)) for b in (0, 4)]
    cases += [(few_shot, b, len(start) + b) for b in (3, thought)]   # at `thought` the model would close it
    expected = []
    for ids, budget, kept in cases:
        head = ref(ids)[0][:kept] + forced
        expected.append((head + ref(ids + head)[0])[:MAX_TOKENS])
    # the thought ends in time (its end tag's tokens count): the output is the free one
    cases += [(few_shot, b, None) for b in (thought + len(end), thought + 9)]
    expected += [free[:MAX_TOKENS]] * 2
    for engine in engines:   # every case in one batch
        outs = engine.generate([ids for ids, _, _ in cases], [SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, thinking_token_budget=budget) for _, budget, _ in cases])
        for (_, budget, _), out, want in zip(cases, outs, expected):
            assert out.outputs[0].token_ids == want, (budget, tok.decode(out.outputs[0].token_ids), tok.decode(want))
    drafted, accepted = _spec_counts(engines[1])
    assert accepted > 0
    for engine in engines:
        assert_drained(engine)
    with pytest.raises(RequestRejected, match="reasoning-parser"):   # an engine that does not know the tags
        llm.engine.add_request("tb", few_shot, SamplingParams(thinking_token_budget=3))


def test_stream_interval_coalesces_a_requests_outputs(llm, prompt_ids):
    """vLLM's stream interval on the engine: the first output at once, then outputs of at least
    `stream_interval` new tokens, the last at the end; the text, ids and step times they carry add
    up to the same output as one output per token."""
    engine = llm.engine
    base = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def run(interval):
        engine.add_request(f"interval-{interval}", prompt_ids["story"], dataclasses.replace(base, stream_interval=interval))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        return outs

    every = run(1)
    final = every[-1].outputs[0]
    for interval, sizes in ((1, [1] * MAX_TOKENS), (5, [1, 5, 5, 5, 5, 3]), (STREAM_FINAL_ONLY, [1, MAX_TOKENS - 1])):
        outs = every if interval == 1 else run(interval)
        assert [o.outputs[0].num_new_tokens for o in outs] == sizes, interval
        assert [len(o.token_times) for o in outs] == sizes, interval      # one step per token here
        assert "".join(o.outputs[0].text_delta for o in outs) == final.text
        assert outs[-1].outputs[0].token_ids == final.token_ids
    assert_drained(llm)


BEAM_TOKENS = 8
BEAM_CASES = [("france", 3, 1.0), ("france", 4, 0.5), ("story", 3, 1.0), ("multi_turn", 4, 2.0), ("code", 2, 1.0)]


def reference_beam_search(model, ids: list[int], width: int, eos: tuple[int, ...], length_penalty: float):
    """vLLM's beam search written out over transformers' float32 forward (its KV cache reordered
    to the chosen beams at each step): [(output ids, cumulative logprob, finished)], best first.
    Asserts that no step and no ranking is decided by a margin numerics could flip."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, bool]] = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    for step in range(BEAM_TOKENS):
        lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        cands = []
        for i, (toks, cum) in enumerate(beams):
            top = torch.topk(lp[i], 2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                if t in eos:
                    done.append((toks, cum + v, True))
                else:
                    cands.append((cum + v, i, t))
        cands.sort(key=lambda c: -c[0])
        if len(cands) > width:
            assert cands[width - 1][0] - cands[width][0] > 1e-3, "a near tie for the last beam: pick another case"
        beams = [(beams[i][0] + [t], v) for v, i, t in cands[:width]]
        if step + 1 < BEAM_TOKENS:
            cache = out.cache
            cache.reorder_cache(torch.tensor([i for _, i, _ in cands[:width]]))
            with torch.no_grad():
                out = model(torch.tensor([[t] for _, _, t in cands[:width]]), cache=cache, use_cache=True)
    ranked = sorted(done + [(b, v, False) for b, v in beams],
                    key=lambda b: b[1] / (len(ids) + len(b[0])) ** length_penalty, reverse=True)
    scores = [b[1] / (len(ids) + len(b[0])) ** length_penalty for b in ranked]
    assert len(scores) <= width or scores[width - 1] - scores[width] > 1e-4, "a near tie in the ranking"
    return ranked[:width]


def test_beam_search_is_vllms_search_over_transformers_logprobs(make_llm, hf_fp32, prompt_ids):
    """use_beam_search, float32: every beam (ids, cumulative logprob, finish reason) as vLLM's
    algorithm gives over transformers' logprobs, for widths 2-4 and three length penalties, the
    searches in one batch on an engine with prefix caching, where each step's beams are requests
    that compute only the tokens past their last cached block."""
    engine = make_llm(dtype="float32", kv_cache_tokens=4096)
    eos = engine.engine.eos_token_ids
    prompts = [prompt_ids[name] for name, _, _ in BEAM_CASES]
    params = [SamplingParams(n=w, use_beam_search=True, max_tokens=BEAM_TOKENS, length_penalty=lp, logprobs=1)
              for _, w, lp in BEAM_CASES]
    computed_before = engine.engine.scheduler.prompt_tokens_total
    outs = engine.generate(prompts, params)
    saw_stop = False
    for (name, width, lp), ids, out in zip(BEAM_CASES, prompts, outs):
        expected = reference_beam_search(hf_fp32, ids, width, eos, lp)
        assert [o.token_ids for o in out.outputs] == [b[0] for b in expected], name
        assert [o.finish_reason for o in out.outputs] == ["stop" if b[2] else "length" for b in expected], name
        assert [o.cumulative_logprob for o in out.outputs] == pytest.approx([b[1] for b in expected], abs=2e-3), name
        for o in out.outputs:   # a beam's logprobs are its tokens'; a finished one's sum leaves out its EOS
            assert o.text == engine.tokenizer.decode(o.token_ids) and len(o.logprobs) == len(o.token_ids)
            total = sum(lps[t].logprob for t, lps in zip(o.token_ids, o.logprobs))
            assert (total == pytest.approx(o.cumulative_logprob)) == (o.finish_reason == "length"), name
        saw_stop |= any(b[2] for b in expected)
    assert saw_stop, "no case finished a beam by EOS"
    # Each step's beam requests found their prompt in the cache up to their last full block.
    block = engine.engine.config.cache.block_size
    most = sum(len(ids) for ids in prompts) + sum(BEAM_TOKENS * w * block for _, w, _ in BEAM_CASES)
    assert engine.engine.scheduler.prompt_tokens_total - computed_before <= most
    assert_drained(engine)
    assert not engine.engine.scheduler.workflows.workflows   # the anonymous calls left no workflow behind


def test_an_aborted_beam_search_answers_with_its_beams_so_far(make_llm, prompt_ids):
    engine = make_llm(dtype="float32", kv_cache_tokens=4096).engine
    engine.add_request("beams", prompt_ids["story"], SamplingParams(n=3, use_beam_search=True, max_tokens=20))
    for _ in range(4):
        assert engine.step() == []    # a beam search answers once, at its end
    engine.abort_request("beams")
    (out,) = engine.step()
    assert out.finished and [o.finish_reason for o in out.outputs] == ["abort"] * 3
    assert all(len(o.token_ids) == len(out.outputs[0].token_ids) > 0 for o in out.outputs)
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.check_invariants()
    assert engine.stats().kv_blocks_used == 0


def test_a_predicted_output_changes_the_steps_not_the_tokens(make_llm, ref, prompt_ids):
    """OpenAI's predicted outputs with prompt lookup on: the reply itself as the prediction, the
    reply with a phrase edited, and unrelated text each give transformers' greedy tokens, the first
    two in far fewer steps than without a prediction."""
    spec = make_llm(dtype="float32", kv_cache_tokens=4096, speculative_config={**SPEC, "num_speculative_tokens": 8})
    ids = prompt_ids["tips"]
    expected, _ = ref(ids)
    edited = expected[:8] + spec.tokenizer.encode(" and the wind", add_special_tokens=False) + expected[11:]
    junk = spec.tokenizer.encode("Lorem ipsum dolor sit amet, " * 4, add_special_tokens=False)

    def steps(prediction, rid):
        spec.engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prediction=prediction))
        n, final = 0, None
        while spec.engine.has_unfinished():
            n += 1
            final = next((o for o in spec.engine.step() if o.finished), final)
        out = final.outputs[0]
        assert out.token_ids == expected, rid
        if prediction is None:
            assert out.accepted_prediction_tokens is None
        else:
            assert out.accepted_prediction_tokens + out.rejected_prediction_tokens == len(prediction)
            assert out.accepted_prediction_tokens >= (len(expected) - 6 if prediction is expected else 0)
        return n

    plain, exact, after_edit, unrelated = (steps(p, f"pred-{i}") for i, p in enumerate((None, expected, edited, junk)))
    assert exact <= 5 and after_edit <= 8 < plain, (plain, exact, after_edit, unrelated)
    assert_drained(spec)


def test_speculative_decoding_bfloat16_same_tokens(make_llm, prompt_ids):
    """bfloat16 with the compiled kernels: verifying k + 1 positions in one query gives the same
    greedy tokens as decoding them one by one."""
    plain = make_llm(dtype="bfloat16", kv_cache_tokens=4096)
    spec = make_llm(dtype="bfloat16", kv_cache_tokens=4096, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    names = list(prompt_ids)
    a = plain.generate([prompt_ids[n] for n in names], params)
    b = spec.generate([prompt_ids[n] for n in names], params)
    for name, x, y in zip(names, a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids, name
    drafted, accepted = _spec_counts(spec)
    assert 0 < accepted < drafted, (drafted, accepted)
    assert_drained(spec)


# --- structured outputs: token masks against transformers with the same masks -------------------
STRUCTURED_TOKENS = 48
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}}
STRUCTURED = {   # name: (prompt, spec)
    "person": (_chat("Describe a fictional programmer as JSON with name, age and languages."),
               StructuredOutputsParams(json=PERSON)),
    "object": (_chat("Give me the capital of France as a JSON object."), StructuredOutputsParams(json_object=True)),
    "phone": (_chat("Make up a phone number."), StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}")),
    "choice": (FRANCE, StructuredOutputsParams(choice=["Paris", "Lyon", "Marseille"])),
    "grammar": ("1, 2, 3, 5, 8, 13,", StructuredOutputsParams(grammar='start: NUM (", " NUM)*\nNUM: /[0-9]+/')),
    # vLLM's structural tags: free text, and after the trigger the tag's schema, which the few-shot
    # examples do not follow ("city" there, "town" here)
    "tag": ('Q: What is the weather in Paris?\nA: <function=get_weather>{"city": "Paris"}</function>\n'
            'Q: What is the weather in Rome?\nA:',
            StructuredOutputsParams(structural_tag=json.dumps({"triggers": ["<function="], "structures": [{
                "begin": "<function=get_weather>", "end": "</function>", "schema": {
                    "type": "object", "additionalProperties": False, "required": ["town"],
                    "properties": {"town": {"type": "string"}}}}]}))),
}


def constrained_reference(model, lltokenizer, ids: list[int], spec, eos: tuple[int, ...]) -> list[int]:
    """transformers' greedy continuation with each step's logits masked by a fresh llguidance
    matcher that follows the tokens chosen: the plain loop sluice's batching, chunking and
    drafting must reproduce."""
    import llguidance

    matcher = llguidance.LLMatcher(lltokenizer, grammar_text(spec))
    assert not matcher.is_error(), matcher.get_error()
    out, past, step_ids = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(STRUCTURED_TOKENS):
            res = model(step_ids, cache=past, use_cache=True)
            past = res.cache if hasattr(res, "cache") else res.past_key_values
            logits = res.logits[0, -1].float()
            mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            logits[~allowed_tokens(mask.unsqueeze(0), logits.shape[0])[0]] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            assert matcher.consume_token(tok)
            if matcher.is_stopped() or tok in eos:
                break
            step_ids = torch.tensor([[tok]])
    return out


@pytest.fixture(scope="module")
def structured_refs(llm, hf_fp32) -> dict[str, tuple[list[int], list[int]]]:
    """name: (prompt ids, transformers' constrained greedy continuation)."""
    import llguidance

    lltok = llguidance.LLTokenizer(llm.tokenizer.info.tokenizer_json, n_vocab=llm.engine.vocab_size,
                                   eos_token=list(llm.engine.eos_token_ids))
    refs = {}
    for name, (prompt, spec) in STRUCTURED.items():
        ids = encode(llm, prompt)
        refs[name] = (ids, constrained_reference(hf_fp32, lltok, ids, spec, llm.engine.eos_token_ids))
    return refs


def _check_structured(name: str, out, expected: list[int]) -> None:
    comp = out.outputs[0]
    assert comp.token_ids == expected, f"{name}: sluice {comp.token_ids} != transformers {expected}"
    spec = STRUCTURED[name][1]
    if spec.kind == "structural_tag":
        _check_tags(comp.text, spec)
    if comp.finish_reason != "stop":
        return
    if spec.kind == "json":
        jsonschema.validate(json.loads(comp.text), spec.json)
    elif spec.kind == "json_object":
        assert isinstance(json.loads(comp.text), dict), comp.text
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, comp.text), comp.text
    elif spec.kind == "choice":
        assert comp.text in spec.choice, comp.text


def _check_tags(text: str, spec: StructuredOutputsParams) -> None:
    """Every complete tagged segment of the output holds JSON of its schema; there is one."""
    (_, begin, schema, end), = spec.structural_tags()[0]
    segments = re.findall(re.escape(begin) + "(.*?)" + re.escape(end), text, flags=re.S)
    assert segments, text
    for seg in segments:
        jsonschema.validate(json.loads(seg), schema)


def test_structured_outputs_match_transformers_with_the_same_masks(llm, structured_refs):
    """float32, one batch: the five kinds of constraint and an unconstrained prompt side by side;
    each constrained output equals transformers' masked greedy loop token for token, ends where
    the grammar ends, and is valid (parses, matches its schema or pattern)."""
    names = list(STRUCTURED)
    params = [SamplingParams(temperature=0.0, max_tokens=STRUCTURED_TOKENS, structured_outputs=STRUCTURED[n][1])
              for n in names]
    free = encode(llm, PROMPTS["tips"])
    outs = llm.generate([structured_refs[n][0] for n in names] + [free],
                        params + [SamplingParams(temperature=0.0, max_tokens=STRUCTURED_TOKENS)])
    for name, out in zip(names, outs):
        _check_structured(name, out, structured_refs[name][1])
    finished = {n: o.outputs[0].finish_reason for n, o in zip(names, outs)}
    assert finished["choice"] == finished["phone"] == finished["person"] == "stop", finished
    assert outs[-1].outputs[0].token_ids == llm.generate([free], SamplingParams(
        temperature=0.0, max_tokens=STRUCTURED_TOKENS))[0].outputs[0].token_ids
    assert_drained(llm)


def test_structured_outputs_with_speculative_decoding_and_chunked_prefill(make_llm, structured_refs):
    """Drafts cut to the grammar and verified under per-position masks, prompts prefilled in
    64-token chunks beside decodes: the same tokens as transformers' plain masked loop."""
    spec = make_llm(dtype="float32", kv_cache_tokens=4096, speculative_config=SPEC, max_num_batched_tokens=64)
    names = list(STRUCTURED)
    outs = spec.generate([structured_refs[n][0] for n in names],
                         [SamplingParams(temperature=0.0, max_tokens=STRUCTURED_TOKENS,
                                         structured_outputs=STRUCTURED[n][1]) for n in names])
    for name, out in zip(names, outs):
        _check_structured(name, out, structured_refs[name][1])
    drafted, accepted = _spec_counts(spec)
    assert accepted > 0, (drafted, accepted)
    assert_drained(spec)


def test_structured_outputs_start_where_the_prompts_thought_closes(make_llm, llm, hf_fp32, ref, structured_refs):
    """With the model's thinking tags known (a reasoning parser), a reply whose prompt opens a
    thought (or, with a one-token start tag, whose first token opens one) thinks freely and is
    constrained from the token after the thought's end (vLLM's rule):
    float32 greedy output is transformers' free thought up to its end (the model's own, or the
    forced one at a thinking budget), then transformers' masked loop from there. A prompt that
    opens no thought is constrained from its first token, as without the tags (and a budget then
    has no thought to cut). With and without speculative decoding."""
    import llguidance

    engines = [make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, reasoning_parser="glm45",
                        **kw) for kw in ({}, {"speculative_config": SPEC})]
    tok = llm.tokenizer
    lltok = llguidance.LLTokenizer(tok.info.tokenizer_json, n_vocab=llm.engine.vocab_size,
                                   eos_token=list(llm.engine.eos_token_ids))
    eos = llm.engine.eos_token_ids
    start, end = (tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    answer = StructuredOutputsParams(regex=r"The answer is \d+\.")
    few_shot = encode(llm, THINK_SHOT) + start              # the model closes this thought itself
    free, _ = ref(few_shot)
    closed = next(i for i in range(len(free)) if free[i:i + len(end)] == end) + len(end)
    person_prompt, person = STRUCTURED["person"]
    person_ids = encode(llm, person_prompt)
    cases = [(few_shot, answer, None, free[:closed]),
             (person_ids + start, person, 5, ref(person_ids + start)[0][:5] + end)]   # closed at its budget
    expected = [head + constrained_reference(hf_fp32, lltok, ids + head, spec, eos) for ids, spec, _, head in cases]
    ids, plain = structured_refs["person"]      # no thought opened: constrained from the first token
    cases.append((ids, person, 2, []))
    expected.append(plain)
    for engine in engines:   # every case in one batch
        outs = engine.generate([c[0] for c in cases], [SamplingParams(
            temperature=0.0, max_tokens=len(want) + 8, structured_outputs=spec, thinking_token_budget=budget)
            for (_, spec, budget, _), want in zip(cases, expected)])
        for (_, spec, _, head), out, want in zip(cases, outs, expected):
            got = out.outputs[0]
            assert got.token_ids == want, (tok.decode(got.token_ids), tok.decode(want))
            assert got.finish_reason == "stop"
            thought, closed_tag, reply = got.text.partition("</think>")
            assert bool(closed_tag) == bool(head) and "<think>" not in reply
            if spec is answer:
                assert re.fullmatch(r"The answer is \d+\.", reply), reply
            else:
                jsonschema.validate(json.loads(reply if head else got.text), PERSON)
        assert_drained(engine)
    # A one-token start tag (here "Thinking", with " So:" its end): a reply whose prompt opens no
    # thought may open one with its first token (the grammar's tokens or the tag); it does on the
    # few-shot prompt, and the JSON reply, whose first token is the grammar's, is as without tags.
    tagged = make_llm(dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, speculative_config=SPEC,
                      reasoning_config={"reasoning_start_str": "Thinking", "reasoning_end_str": " So:"})
    shot = [{"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "Thinking two plus two makes four. So: The answer is 4."},
            {"role": "user", "content": "What is 3 plus 3?"},
            {"role": "assistant", "content": "Thinking three plus three makes six. So: The answer is 6."},
            {"role": "user", "content": "What is 5 plus 5?"}]
    shot_ids, so = encode(llm, shot), tok.encode(" So:", add_special_tokens=False)
    free, _ = ref(shot_ids)
    assert free[0] == tok.encode("Thinking", add_special_tokens=False)[0], tok.decode(free)
    head = free[:next(i for i in range(len(free)) if free[i:i + len(so)] == so) + len(so)]
    spaced = StructuredOutputsParams(regex=r" The answer is \d+\.")
    want = [head + constrained_reference(hf_fp32, lltok, shot_ids + head, spaced, eos), plain]
    outs = tagged.generate([shot_ids, ids], [SamplingParams(temperature=0.0, max_tokens=STRUCTURED_TOKENS,
                                                             structured_outputs=spec) for spec in (spaced, person)])
    for out, expected_ids in zip(outs, want):
        assert out.outputs[0].token_ids == expected_ids, (tok.decode(out.outputs[0].token_ids), tok.decode(expected_ids))
        assert out.outputs[0].finish_reason == "stop"
    assert_drained(tagged)


def test_structured_outputs_sampled_with_n_and_a_seed_stay_valid(make_llm):
    """Random sampling (temperature 1, n=4, bfloat16, drafts on): every sample obeys the grammar."""
    engine = make_llm(dtype="bfloat16", kv_cache_tokens=4096, speculative_config=SPEC)
    spec = STRUCTURED["phone"][1]
    [out] = engine.generate([encode(engine, STRUCTURED["phone"][0])], SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=STRUCTURED_TOKENS, structured_outputs=spec))
    assert len(out.outputs) == 4
    for comp in out.outputs:
        assert comp.finish_reason == "stop" and re.fullmatch(spec.regex, comp.text), comp.text
    assert len({c.text for c in out.outputs}) > 1
    assert_drained(engine)


def test_min_tokens_holds_the_end_back_only_where_the_grammar_allows_more(llm):
    """min_tokens with a constraint: the end token is suppressed while the grammar allows
    something else (the output grows to min_tokens), and yields where the grammar is complete."""
    prompt = encode(llm, _chat("Reply with one word."))
    laugh = StructuredOutputsParams(regex="(ha)+")
    [short] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=laugh))
    n = len(short.outputs[0].token_ids)
    assert short.outputs[0].finish_reason == "stop" and n < 12, short.outputs[0]   # it ends on its own
    held = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=n + 4, structured_outputs=laugh)
    [long] = llm.generate([prompt], held)
    assert len(long.outputs[0].token_ids) >= n + 4 and re.fullmatch("(ha)+", long.outputs[0].text), long.outputs[0]
    # a closed JSON object: once "}" is out only the end token is allowed, well before min_tokens
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    done = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20,
                          structured_outputs=StructuredOutputsParams(json=schema))
    [obj] = llm.generate([prompt], done)
    assert obj.outputs[0].finish_reason == "stop" and json.loads(obj.outputs[0].text)["a"] in ("x", "y"), obj.outputs[0]
    assert len(obj.outputs[0].token_ids) < 20
    assert_drained(llm)
