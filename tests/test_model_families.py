"""Qwen2, Qwen3, Qwen3-MoE, Mixtral and GLM-4.5 against transformers, through the real engine.

Each variant is a tiny random-weight model built with transformers' own config and model
classes, saved as safetensors (the mixture-of-experts ones per expert, as transformers writes
them) with a word-level tokenizer, and served by `LLM(folder)`. Checked per variant: full-vocab
logits of a prefill split into chunks plus a decode; the engine's greedy tokens and top-5
logprobs alone, batched, on a prefix-cache hit, with chunked prefill and under preemption,
against `generate(do_sample=False)` and the log-softmax of its logits. The fused experts layer
is also checked on its own against a per-token loop, with and without `torch._grouped_mm`, and
a fused-layout checkpoint must load to the same parameters as the per-expert one.

Tolerance: float32, logits and logprobs within 1e-4 absolute. Both sides do the same float32
math in another order (fused projections, rotary from a table, paged SDPA, experts as grouped
matmuls over rows sorted by expert); the observed difference is at most 3e-5 (the tied-embedding
variants, whose logits are the largest), 5e-6 to 8e-6 for the others. A wrong bias, norm, rotary
slice, routing rule or scaling factor moves logits by O(0.1) or more.
Routing is discrete, so a 1e-6 difference could in principle flip an expert choice at a near
tie; the weights are scaled so router scores are well separated, and the greedy-token check
would fail loudly (not flakily pass) if it happened.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import (Glm4MoeConfig, Glm4MoeForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from sluice.attention import AttentionMetadata, create_backend
from sluice.llm import LLM
from sluice.model.loader import load_model, load_model_config
from sluice.model.moe import FusedExperts, SparseMoeBlock, fused_experts
from sluice.sampling_params import SamplingParams
from sched_utils import no_waiting_for_blocks

VOCAB = 256
ATOL = 1e-4
MAX_TOKENS = 12
BOS, EOS = 1, 2
_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
               bos_token_id=BOS, eos_token_id=EOS)


@dataclass(frozen=True)
class Variant:
    name: str
    config: Callable[[], object]          # builds the transformers config
    model: type[PreTrainedModel]
    moe: bool = False


VARIANTS = [
    # q/k/v bias, tied embeddings.
    Variant("qwen2_tied", lambda: Qwen2Config(**_COMMON, tie_word_embeddings=True), Qwen2ForCausalLM),
    # q/k norm, attention bias on q/k/v/o, head_dim != hidden / heads.
    Variant("qwen3_bias", lambda: Qwen3Config(**_COMMON, head_dim=32, attention_bias=True,
                                              tie_word_embeddings=False), Qwen3ForCausalLM),
    # softmax top-2 of 8 without renormalisation; layer 1 is dense (mlp_only_layers); 3 layers.
    Variant("qwen3_moe", lambda: Qwen3MoeConfig(**{**_COMMON, "num_hidden_layers": 3}, num_experts=8,
                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                norm_topk_prob=False, mlp_only_layers=[1],
                                                tie_word_embeddings=True), Qwen3MoeForCausalLM, moe=True),
    # softmax top-2 of 4, renormalised; block_sparse_moe / w1 w2 w3 checkpoint names.
    Variant("mixtral", lambda: MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2),
            MixtralForCausalLM, moe=True),
    # sigmoid + correction bias, 4 groups choosing 2, top-3, scaling 2.5, a shared expert, a dense
    # first layer, q/k norm, q/k/v bias, half the head rotary; 3 layers.
    Variant("glm4_moe", lambda: Glm4MoeConfig(**{**_COMMON, "num_hidden_layers": 3}, n_routed_experts=8,
                                              num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
                                              n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                              norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True,
                                              attention_bias=True),
            Glm4MoeForCausalLM, moe=True),
    # ungrouped, unnormalised, two shared experts, a quarter of the head rotary, no q/k norm.
    Variant("glm4_moe_plain", lambda: Glm4MoeConfig(**_COMMON, n_routed_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, n_shared_experts=2, n_group=1,
                                                    topk_group=1, norm_topk_prob=False, first_k_dense_replace=0,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.25}),
            Glm4MoeForCausalLM, moe=True),
]

_g = torch.Generator().manual_seed(4321)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_g).tolist() for n in (5, 17, 40, 70)]
_PREFIX = torch.randint(3, VOCAB, (32,), generator=_g).tolist()     # two 16-token blocks
PREFIX_PROMPTS = [_PREFIX + torch.randint(3, VOCAB, (n,), generator=_g).tolist() for n in (3, 20)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)


def _randomize(model: PreTrainedModel, seed: int) -> None:
    """O(1) activations and well separated logits and router scores (the default 0.02 init makes
    both nearly flat). Covers GLM's e_score_correction_bias, a buffer in transformers."""
    g = torch.Generator().manual_seed(seed)
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if "correction_bias" in n)]
    with torch.no_grad():
        for name, p in tensors:
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # Linear [out, in] and stacked experts [E, out, in]: scale by fan-in
                p.copy_(noise * 1.5 / p.shape[-1] ** 0.5)


def _write_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}))


@dataclass
class Setup:
    variant: Variant
    folder: Path
    hf: PreTrainedModel
    llm: LLM              # block 16, prefix caching
    chunked: LLM          # block 32, a 24-token step budget, no prefix caching
    tight: LLM            # a 96-token KV cache: a batch of the prompts must preempt
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
            self.refs[key] = tokens, torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        return self.refs[key]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from a thread pool, and on a shared, busy CPU its spinning
    workers make each op wait ~15 ms; run this module single-threaded, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=VARIANTS, ids=[v.name for v in VARIANTS])
def setup(request, tmp_path_factory) -> Setup:
    v: Variant = request.param
    torch.manual_seed(0)
    config = v.config()
    # transformers' per-expert loop, not its grouped_mm path: the reference must not share
    # torch._grouped_mm with the code under test.
    config._experts_implementation = "eager"
    hf = v.model(config).eval()
    assert hf.config._experts_implementation == "eager"
    _randomize(hf, seed=VARIANTS.index(v))
    folder = tmp_path_factory.mktemp(v.name)
    hf.save_pretrained(folder)   # safetensors; experts one by one
    _write_tokenizer(folder)
    common = dict(dtype="float32", max_model_len=128)
    return Setup(
        variant=v, folder=folder, hf=hf,
        llm=LLM(str(folder), kv_cache_tokens=2048, block_size=16, **common),
        chunked=LLM(str(folder), kv_cache_tokens=2048, block_size=32, max_num_batched_tokens=24,
                    enable_prefix_caching=False, **common),
        tight=LLM(str(folder), dtype="float32", max_model_len=96, kv_cache_tokens=96, block_size=16),
    )


def _assert_matches(s: Setup, prompt: list[int], out) -> None:
    ref_tokens, ref_lp = s.reference(prompt)
    comp = out.outputs[0]
    assert comp.token_ids == ref_tokens, f"{s.variant.name}: prompt of {len(prompt)} tokens"
    assert len(comp.logprobs) == len(ref_tokens)
    for step, (tok, lps) in enumerate(zip(ref_tokens, comp.logprobs)):
        assert lps[tok].rank == 1
        ids = list(lps)
        got = torch.tensor([lps[t].logprob for t in ids])
        torch.testing.assert_close(got, ref_lp[step, ids], atol=ATOL, rtol=0,
                                   msg=lambda m, step=step: f"{s.variant.name} step {step}: {m}")


def _drained(llm: LLM) -> None:
    llm.engine.scheduler.check_invariants()
    assert llm.engine.stats().kv_blocks_used == 0


def _meta(num_computed: int, n: int, num_blocks: int) -> AttentionMetadata:
    """One sequence in blocks 0..num_blocks-1 (of 16), computing positions num_computed..+n."""
    end = num_computed + n
    return AttentionMetadata(
        slot_mapping=torch.arange(num_computed, end, dtype=torch.int64),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        num_decodes=1 if n == 1 else 0,
        max_query_len=n, max_seq_len=end, query_lens_list=[n], seq_lens_list=[end],
    )


# --- the model alone -------------------------------------------------------------------------
@torch.inference_mode()
def test_logits_of_chunked_prefill_and_decode(setup):
    """Full-vocab logits at every position of a 70-token prompt computed as chunks 29 + 40 + 1."""
    model = setup.llm.engine.runner.model
    m = setup.llm.engine.config.model
    prompt = PROMPTS[-1]
    shape = (8, 16, m.num_key_value_heads, m.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(m.num_hidden_layers)]
    logits, done = [], 0
    for n in (29, 40, 1):
        hidden = model(torch.tensor(prompt[done:done + n]), torch.arange(done, done + n), kv, _meta(done, n, 8))
        logits.append(model.compute_logits(hidden))                                        # [n, vocab]
        done += n
    expected = setup.hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(torch.cat(logits), expected, atol=ATOL, rtol=0)


def test_moe_layers_are_fused(setup):
    """The layers transformers builds as mixtures are fused-experts layers here, and vice versa."""
    model = setup.llm.engine.runner.model
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in setup.hf.model.layers]
    assert ours == theirs and any(ours) == setup.variant.moe
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            assert isinstance(layer.mlp.experts, FusedExperts)


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
        assert out.num_cached_tokens >= 32, "the shared two-block prefix should come from the cache"
        _assert_matches(setup, prompt, out)
    _drained(setup.llm)


def test_greedy_with_chunked_prefill(setup):
    outs = setup.chunked.generate(PROMPTS + PREFIX_PROMPTS, PARAMS)
    for prompt, out in zip(PROMPTS + PREFIX_PROMPTS, outs):
        _assert_matches(setup, prompt, out)
    _drained(setup.chunked)


def test_greedy_under_preemption(setup, monkeypatch):
    no_waiting_for_blocks(monkeypatch)  # this test is about preemption itself
    llm = setup.tight
    before = llm.engine.stats().num_preemptions
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.stats().num_preemptions > before, "a 96-token KV cache cannot hold the whole batch"
    for prompt, out in zip(prompts, outs):
        _assert_matches(setup, prompt, out)
    _drained(llm)


# --- weight loading ----------------------------------------------------------------------------
def test_fused_expert_checkpoint_loads_like_per_expert(setup, tmp_path):
    """transformers 5's fused layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) loads to exactly the parameters the per-expert checkpoint gave; GLM's
    multi-token-prediction layer after the last decoder layer is skipped."""
    if not setup.variant.moe:
        pytest.skip("dense architecture")
    tensors = load_file(str(setup.folder / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        if ".experts." not in name:
            fused[name] = tensors[name]
    for layer, hf_layer in enumerate(setup.hf.model.layers):
        experts = getattr(hf_layer.mlp, "experts", None)
        if experts is not None:
            fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = experts.gate_up_proj.detach().clone()
            fused[f"model.layers.{layer}.mlp.experts.down_proj"] = experts.down_proj.detach().clone()
    for name in [n for n in fused if "block_sparse_moe" in n]:   # Mixtral's router
        fused[name.replace("block_sparse_moe", "mlp")] = fused.pop(name)
    config = json.loads((setup.folder / "config.json").read_text())
    if config.get("num_nextn_predict_layers"):  # GLM checkpoints carry MTP layers; skipped
        fused[f"model.layers.{config['num_hidden_layers']}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(fused, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((setup.folder / "config.json").read_text())
    cfg = load_model_config(tmp_path)
    model = load_model(tmp_path, cfg, torch.float32, create_backend("torch"))
    expected = dict(setup.llm.engine.runner.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name], atol=0, rtol=0, msg=name)


def test_a_missing_expert_tensor_is_refused(setup, tmp_path):
    """Per-expert loading fills stacked tensors slice by slice; one absent expert must not
    leave uninitialised rows behind."""
    if not setup.variant.moe:
        pytest.skip("dense architecture")
    tensors = load_file(str(setup.folder / "model.safetensors"))
    dropped = next(n for n in sorted(tensors) if ".experts.1." in n and ("down_proj" in n or ".w2." in n))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((setup.folder / "config.json").read_text())
    with pytest.raises(ValueError, match="missing.*experts.down_proj"):
        load_model(tmp_path, load_model_config(tmp_path), torch.float32, create_backend("torch"))


@torch.inference_mode()
def test_bfloat16_keeps_the_router_in_float32(setup):
    """In a bfloat16 model GLM's router weight and correction bias stay float32 (as transformers
    keeps them), the other routers follow the model dtype, and a forward pass runs. bf16
    accuracy against transformers is not asserted here: one flipped expert choice in bf16
    moves a tiny random model's logprobs by nats (measured: medians within the bf16-vs-fp32
    noise of transformers itself)."""
    if not setup.variant.moe:
        pytest.skip("dense architecture")
    cfg = load_model_config(setup.folder)
    model = load_model(setup.folder, cfg, torch.bfloat16, create_backend("torch"))
    router = torch.float32 if cfg.architecture == "Glm4MoeForCausalLM" else torch.bfloat16
    for name, p in model.named_parameters():
        assert p.dtype == (router if ".gate." in name else torch.bfloat16), name
    shape = (2, 16, cfg.num_key_value_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
          for _ in range(cfg.num_hidden_layers)]
    prompt = PROMPTS[1]
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), kv, _meta(0, len(prompt), 2))
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(model.compute_logits(hidden)).all()


@pytest.mark.parametrize("use_kernel", [True, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_match_a_per_token_loop(use_kernel, dtype):
    if use_kernel and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is unavailable")
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 37, 32, 16, 8, 3
    x = torch.randn(t, h, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, generator=g) / i ** 0.5
    ids = torch.rand(t, e, generator=g).argsort(dim=-1)[:, :k]
    ids[ids == 5] = 0                                     # expert 5 gets no rows
    ids[:, 0] = torch.where(ids[:, 1] == 0, 6, ids[:, 0])  # keep each token's k experts distinct
    weights = torch.rand(t, k, generator=g)
    expected = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            gate, up = (gate_up[ids[tok, j]] @ x[tok]).chunk(2)
            expected[tok] += weights[tok, j] * (down[ids[tok, j]] @ (torch.nn.functional.silu(gate) * up))
    got = fused_experts(x.to(dtype), gate_up.to(dtype), down.to(dtype), ids, weights, use_kernel=use_kernel)
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol if dtype != torch.float32 else 0)
