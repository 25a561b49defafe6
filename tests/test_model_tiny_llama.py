"""Random-weight tiny Llamas: sluice against transformers, through the real engine.

Each variant is built with transformers, saved as safetensors with a word-level tokenizer, and
loaded by `LLM(folder)`. Checked: full-vocab logits of the model over a prefill split into
chunks plus a decode, the engine's greedy tokens and logprobs alone, batched, on a prefix-cache
hit, with chunked prefill and under preemption.

Tolerance: float32 logits and logprobs within 1e-4 absolute. Both sides compute the same
float32 math in a different order (fused QKV and gate/up projections, rotary in a table,
paged SDPA); the largest difference measured over all variants is 3e-5, so 1e-4 is loose
enough to be stable and tight enough that a wrong rope frequency, a missing bias or a
misplaced head (all O(0.1) or more) cannot pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM

from sluice.attention import AttentionMetadata
from sluice.engine.llm_engine import WorkflowInfo
from sluice.llm import LLM
from sluice.sampling_params import SamplingParams
from sched_utils import no_waiting_for_blocks

VOCAB = 512
ATOL = 1e-4
MAX_TOKENS = 16
BOS, EOS = 1, 2


@dataclass(frozen=True)
class Variant:
    name: str
    config: dict = field(default_factory=dict)       # LlamaConfig overrides
    legacy_rope: bool = False                         # rewrite config.json the transformers-4 way


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           # small, so the scaled and smoothed bands both fall inside the tested positions
           "original_max_position_embeddings": 64}

VARIANTS = [
    Variant("gqa_untied", {"num_key_value_heads": 2}),
    Variant("mha_tied", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    Variant("bias", {"num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}),
    Variant("head_dim_32", {"num_key_value_heads": 2, "head_dim": 32}),
    Variant("llama3_rope", {"num_key_value_heads": 2, "rope_parameters": {**_LLAMA3, "rope_theta": 10000.0}}),
    Variant("linear_rope", {"num_key_value_heads": 1, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                          "rope_theta": 10000.0}}),
    Variant("legacy_rope_theta", {"num_key_value_heads": 2,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
            legacy_rope=True),
    Variant("legacy_llama3", {"num_key_value_heads": 2, "rope_parameters": {**_LLAMA3, "rope_theta": 50000.0}},
            legacy_rope=True),
]

_g = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_g).tolist() for n in (5, 17, 40, 90)]
_PREFIX = torch.randint(3, VOCAB, (48,), generator=_g).tolist()     # three 16-token blocks
PREFIX_PROMPTS = [_PREFIX + torch.randint(3, VOCAB, (n,), generator=_g).tolist() for n in (3, 9, 20)]
# Two blocks each: together they fill the 8-block tight cache, and each needs a third block
# within a few decode steps, so some must be preempted and recomputed.
TIGHT_PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_g).tolist() for n in (30, 27, 31, 29)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
# Prompts no other test sends (the engines are shared by the module: a block another test's call
# put in the prefix cache first would keep this test's copy of it private, and not retained).
_g_tail = torch.Generator().manual_seed(4321)
TAIL_PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_g_tail).tolist() for n in (40, 61, 37, 5, 9, 17)]


def _randomize(model: LlamaForCausalLM, seed: int) -> None:
    """Weights with O(1) activations and well separated logits (the default 0.02 init makes the
    next-token distribution nearly flat, so greedy would hinge on 1e-6 differences)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 1.5 / p.shape[1] ** 0.5)


def _write_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}))


def _legacy_rope(folder: Path) -> None:
    """Spell the rope settings as transformers 4 did: top-level rope_theta (+ rope_scaling)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type") != "default":
        cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The CPUs are shared: one intra-op thread avoids OpenMP spin-waits on a loaded machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@dataclass
class Setup:
    variant: Variant
    hf: LlamaForCausalLM
    llm: LLM              # block 16, prefix caching
    chunked: LLM          # block 32, a 24-token step budget, no prefix caching
    tight: LLM            # a 128-token (8-block) KV cache
    refs: dict = field(default_factory=dict)

    def reference(self, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """transformers' greedy tokens and per-step log-softmax [steps, vocab], memoized."""
        key = tuple(prompt)
        if key not in self.refs:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=MAX_TOKENS, output_logits=True,
                                       return_dict_in_generate=True, pad_token_id=EOS)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
            self.refs[key] = tokens, logprobs
        return self.refs[key]


@pytest.fixture(scope="module", params=VARIANTS, ids=[v.name for v in VARIANTS])
def setup(request, tmp_path_factory) -> Setup:
    v: Variant = request.param
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5,
                      bos_token_id=BOS, eos_token_id=EOS, **v.config)
    hf = LlamaForCausalLM(cfg).eval()
    _randomize(hf, seed=VARIANTS.index(v))
    folder = tmp_path_factory.mktemp(v.name)
    hf.save_pretrained(folder)   # safetensors
    if v.legacy_rope:
        _legacy_rope(folder)
    _write_tokenizer(folder)
    common = dict(dtype="float32", max_model_len=256)
    return Setup(
        variant=v,
        hf=hf,
        llm=LLM(str(folder), kv_cache_tokens=4096, block_size=16, enable_prefix_caching=True, **common),
        chunked=LLM(str(folder), kv_cache_tokens=4096, block_size=32, max_num_batched_tokens=24,
                    enable_prefix_caching=False, **common),
        tight=LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_tokens=128, block_size=16,
                  enable_prefix_caching=True),
    )


def _assert_matches(s: Setup, prompt: list[int], out) -> None:
    ref_tokens, ref_lp = s.reference(prompt)
    comp = out.outputs[0]
    assert comp.token_ids == ref_tokens, f"{s.variant.name}: prompt of {len(prompt)} tokens"
    if comp.logprobs is None:
        return
    assert len(comp.logprobs) == len(ref_tokens)
    for step, (tok, lps) in enumerate(zip(ref_tokens, comp.logprobs)):
        assert lps[tok].rank == 1
        ids = list(lps)
        got = torch.tensor([lps[t].logprob for t in ids])
        torch.testing.assert_close(got, ref_lp[step, ids], atol=ATOL, rtol=0,
                                   msg=lambda m, step=step: f"step {step}: {m}")


def _drained(llm: LLM) -> None:
    llm.engine.scheduler.check_invariants()
    assert llm.engine.stats().kv_blocks_used == 0


# --- the model alone -------------------------------------------------------------------------
def _meta(num_computed: int, n: int, block_size: int, num_blocks: int) -> AttentionMetadata:
    """One sequence, blocks 0..num_blocks-1 in order, computing positions num_computed..+n."""
    end = num_computed + n
    return AttentionMetadata(
        slot_mapping=torch.arange(num_computed, end, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        num_decodes=1 if n == 1 else 0,
        max_query_len=n, max_seq_len=end, query_lens_list=[n], seq_lens_list=[end],
    )


@torch.inference_mode()
def test_logits_of_chunked_prefill_and_decode(setup):
    """Full-vocab logits at every position of a 90-token prompt computed as chunks 37 + 52 + 1."""
    model = setup.llm.engine.runner.model
    m = setup.llm.engine.config.model
    prompt = PROMPTS[-1]
    bs, nb = 16, 8
    kv = [(torch.zeros(nb, bs, m.num_key_value_heads, m.head_dim), torch.zeros(nb, bs, m.num_key_value_heads,
                                                                                  m.head_dim))
          for _ in range(m.num_hidden_layers)]
    logits = []
    done = 0
    for n in (37, 52, 1):
        ids = torch.tensor(prompt[done:done + n])
        hidden = model(ids, torch.arange(done, done + n), kv, _meta(done, n, bs, nb))    # [n, hidden]
        logits.append(model.compute_logits(hidden))                                        # [n, vocab]
        done += n
    got = torch.cat(logits)
    expected = setup.hf(torch.tensor([prompt])).logits[0]
    assert got.shape == expected.shape == (len(prompt), VOCAB)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# --- through the engine ----------------------------------------------------------------------
def test_greedy_alone(setup):
    for prompt in PROMPTS:
        [out] = setup.llm.generate([prompt], PARAMS)
        _assert_matches(setup, prompt, out)
    _drained(setup.llm)


def test_greedy_batched(setup):
    outs = setup.llm.generate(PROMPTS, PARAMS)
    for prompt, out in zip(PROMPTS, outs):
        _assert_matches(setup, prompt, out)
    _drained(setup.llm)


def test_greedy_with_prefix_cache_hit(setup):
    first, *rest = PREFIX_PROMPTS
    [out] = setup.llm.generate([first], PARAMS)
    _assert_matches(setup, first, out)
    outs = setup.llm.generate(rest, PARAMS)
    for prompt, out in zip(rest, outs):
        assert out.num_cached_tokens >= 48, "the shared three-block prefix should come from the cache"
        _assert_matches(setup, prompt, out)
    _drained(setup.llm)


def test_greedy_with_chunked_prefill(setup):
    outs = setup.chunked.generate(PROMPTS + PREFIX_PROMPTS, PARAMS)
    for prompt, out in zip(PROMPTS + PREFIX_PROMPTS, outs):
        _assert_matches(setup, prompt, out)
    _drained(setup.chunked)


def test_greedy_when_blocks_run_short(setup):
    """The same tight cache with the scheduler's defaults: requests short of a block shrink
    their chunks or wait while others progress (preempting only when nothing can), and every
    output still equals the reference."""
    llm = setup.tight
    outs = llm.generate(TIGHT_PROMPTS, PARAMS)
    for prompt, out in zip(TIGHT_PROMPTS, outs):
        _assert_matches(setup, prompt, out)
    _drained(llm)


def test_greedy_under_preemption(setup, monkeypatch):
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    llm = setup.tight
    before = llm.engine.stats().num_preemptions
    outs = llm.generate(TIGHT_PROMPTS, PARAMS)
    assert llm.engine.stats().num_preemptions > before, "8 blocks cannot hold 4 sequences of 3 blocks"
    for prompt, out in zip(TIGHT_PROMPTS, outs):
        _assert_matches(setup, prompt, out)
    _drained(llm)




def test_beam_searches_in_a_cache_too_small_for_their_beams(setup):
    """Three width-3 beam searches and two plain calls at once in the 8-block cache, where a
    step's three beams (three blocks each) cannot all run together: beam requests wait for blocks
    while others run, and every search still returns what it returns alone in a large cache; every
    block is accounted for after, and the calls' workflows (one named) are closed."""
    if setup.variant.name != "gqa_untied":
        pytest.skip("the scheduler's part: one variant is enough")
    beams = SamplingParams(n=3, use_beam_search=True, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [setup.llm.generate([p], beams)[0] for p in TIGHT_PROMPTS[:3]]
    engine = setup.tight.engine
    for i, p in enumerate(TIGHT_PROMPTS[:3]):
        engine.add_request(f"beams-{i}", p, beams, WorkflowInfo("agent") if i == 0 else None)
    engine.add_request("plain", TIGHT_PROMPTS[3], PARAMS)
    engine.add_request("plain-2", TIGHT_PROMPTS[0][:20], PARAMS)
    final, beams_waited = {}, False
    while engine.has_unfinished():
        outs = engine.step()
        sch = engine.scheduler
        beams_waited |= bool(sch.running) and any(r.part_of_call for r in sch.waiting)
        for out in outs:
            if out.request_id.startswith("beams"):   # a beam search answers once, at its end
                assert out.finished and len(out.outputs) == 3
            if out.finished:
                final[out.request_id] = out
    assert beams_waited
    for i, expected in enumerate(alone):
        got = final[f"beams-{i}"]
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in expected.outputs], i
        assert [o.cumulative_logprob for o in got.outputs] == pytest.approx([o.cumulative_logprob for o in expected.outputs])
    _assert_matches(setup, TIGHT_PROMPTS[3], final["plain"])
    _drained(setup.tight)
    wf = engine.scheduler.workflows.workflows
    assert set(wf) <= {"agent"} and all(w.active_calls == 0 and w.retention is None for w in wf.values())

def _call(llm: LLM, rid: str, prompt: list[int], workflow: str, last: bool = False, after_first_step=None):
    llm.engine.add_request(rid, prompt, PARAMS, WorkflowInfo(workflow, is_last_step=last))
    final, first = None, True
    while llm.engine.has_unfinished():
        outs = llm.engine.step()
        if first and after_first_step is not None:
            after_first_step(llm.engine.scheduler.requests[rid])
        first = False
        for out in outs:
            if out.finished and out.request_id == rid:
                final = out
    return final


def test_greedy_workflow_calls_continue_in_the_retained_tail_block(setup):
    """A workflow's next call takes over the partly filled last block its previous call left
    retained, computing only the tokens after those the block holds; and a call that continues
    only part of the tail overwrites the rest. Outputs equal the reference either way."""
    llm = setup.llm
    wf = f"tail-{setup.variant.name}"
    tracker = llm.engine.scheduler.workflows
    def with_tail(candidates):   # a prompt whose call leaves >= 2 tokens in a partly filled block
        return next(p for p in candidates if (len(p) + len(setup.reference(p)[0]) - 1) % 16 >= 2)

    p1 = with_tail(TAIL_PROMPTS[:3])
    out1 = _call(llm, "tail-1", p1, wf)
    _assert_matches(setup, p1, out1)
    kv1 = len(p1) + len(out1.outputs[0].token_ids) - 1       # the last token has no KV yet
    retention = tracker.workflows[wf].retention
    assert kv1 % 16 and len(retention.tail_tokens) == kv1 % 16
    tail_block = retention.blocks[-1]

    conversation = p1 + out1.outputs[0].token_ids
    p2 = with_tail([conversation + p for p in TAIL_PROMPTS[3:]])
    seen = []
    out2 = _call(llm, "tail-2", p2, wf, after_first_step=lambda r: seen.append(r.blocks[kv1 // 16]))
    assert seen == [tail_block] and out2.num_cached_tokens == kv1
    _assert_matches(setup, p2, out2)

    # The next call continues only part of the tail: the rest of the block is overwritten.
    whole = p2 + out2.outputs[0].token_ids
    kv2 = len(whole) - 1
    tail2 = tracker.workflows[wf].retention.tail_tokens
    assert kv2 % 16 >= 2 and len(tail2) == kv2 % 16
    cut = kv2 - kv2 % 16 + (kv2 % 16) // 2
    p3 = whole[:cut] + TAIL_PROMPTS[5][:6]
    out3 = _call(llm, "tail-3", p3, wf, last=True)
    assert out3.num_cached_tokens == cut
    _assert_matches(setup, p3, out3)
    assert wf not in tracker.workflows or tracker.workflows[wf].retention is None
    _drained(llm)


# --- speculative decoding keeps the sampling law ---------------------------------------------
def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square with df degrees of freedom (Wilson-Hilferty; z = 3.719 is the
    1e-4 tail of the normal), so this test fails by chance once in ten thousand runs."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * c ** 0.5) ** 3


def test_random_sampling_with_drafts_has_the_model_distribution(tmp_path):
    """Temperature 1 with top-k 3: the law of four sampled tokens through verified drafts equals
    the model's exact law (computed from transformers), by a chi-square test over the 81 paths.
    The drafts come from a proposer that guesses each request's most likely continuation, so
    steps accept some drafts and reject others, exercising both rules."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                      rms_norm_eps=1e-5, bos_token_id=BOS, eos_token_id=EOS)
    hf = LlamaForCausalLM(cfg).eval()
    _randomize(hf, seed=99)
    with torch.no_grad():   # flatter logits: each of the top 3 gets real probability
        hf.lm_head.weight.mul_(0.25)
    hf.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    prompt, k, steps = PROMPTS[1], 3, 4
    memo: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def top(ctx: tuple[int, ...]) -> tuple[list[int], list[float]]:
        """The top-k next tokens after ctx and their renormalized probabilities."""
        if ctx not in memo:
            with torch.no_grad():
                logits = hf(torch.tensor([list(ctx)])).logits[0, -1].float()
            vals, ids = logits.topk(k)
            memo[ctx] = ids.tolist(), torch.softmax(vals, dim=-1).tolist()
        return memo[ctx]

    exact: dict[tuple[int, ...], float] = {}

    def walk(path: tuple[int, ...], p: float) -> None:
        if len(path) == steps:
            exact[path] = p
            return
        for t, q in zip(*top(tuple(prompt) + path)):
            walk(path + (t,), p * q)

    walk((), 1.0)

    class GuessProposer:   # drafts the greedy continuation of the request's context
        def propose(self, req, max_k):
            ctx, drafts = tuple(req.all_token_ids), []
            for _ in range(max(0, min(2, max_k))):
                drafts.append(top(ctx + tuple(drafts))[0][0])
            return drafts

    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_tokens=8192, max_num_seqs=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm.engine.scheduler.proposer = GuessProposer()
    n = 3000
    params = SamplingParams(temperature=1.0, top_k=k, max_tokens=steps, ignore_eos=True)
    outs = llm.generate([prompt] * n, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "sampled a path outside the top-k paths"
    st = llm.engine.stats()
    assert 0.2 * st.spec_draft_tokens_total < st.spec_accepted_tokens_total < 0.95 * st.spec_draft_tokens_total
    # chi-square over paths with enough expected mass; the rest pooled
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for path, p in exact.items():
        e, o = n * p, counts.get(path, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    assert df >= 10, exact
    assert stat < _chi2_critical(df), (stat, df, _chi2_critical(df))
