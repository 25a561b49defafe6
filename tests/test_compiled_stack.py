"""The decoder stack as one compiled call (sluice/model/compiled_stack.py, attention/cpu/stack.cpp).

The op runs the kernels the Python layer loop runs, in the same order on the same tensors, so
the check is exact: hidden states and every layer's K/V cache bit-identical to the loop's, on
batches that mix decodes, chunks after a cached prefix and fresh prefills. Which models get the
op is checked by structure: anything with a shape it does not cover keeps the Python loop.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.attention import create_backend
from sluice.attention.cpu import extension
from sluice.config import ModelConfig
from sluice.model.compiled_stack import CompiledDecoderStack, unsupported_reason
from sluice.model.packed_linear import use_cpu_kernels
from sluice.model.registry import create_model
from test_model_tiny_llama import _randomize
from test_attention_backend import DECODES_ONLY, MIXED, PREFILLS_ONLY, SeqCase, build_metadata

pytestmark = pytest.mark.skipif(bool(extension.missing_cpu_flags()),
                                reason=f"CPU lacks {extension.missing_cpu_flags()}")

BLOCK, NUM_BLOCKS = 16, 64


def _config(arch: str = "LlamaForCausalLM", **over) -> ModelConfig:
    base = dict(architecture=arch, model_type="llama", vocab_size=320, hidden_size=192, intermediate_size=320,
                num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True)
    base.update(over)
    return ModelConfig(**base)


def _model(cfg: ModelConfig, backend: str = "cpu", seed: int = 0):
    """A random bf16 model (O(1) activations, as tests/test_model_tiny_llama.py draws them) moved
    onto the CPU kernels as the loader does."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = create_model(cfg, create_backend(backend))
    finally:
        torch.set_default_dtype(prev)
    _randomize(model, seed)
    if backend == "cpu":
        use_cpu_kernels(model)
    return model.eval()


def _caches(cfg: ModelConfig, dtype=torch.bfloat16, seed: int = 1):
    """Caches holding random earlier context, so attention over the prefix matters."""
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(cfg.num_hidden_layers)]


def _run_both(model, cfg: ModelConfig, cases: list[SeqCase], seed: int = 2):
    meta, seq_slots = build_metadata(cases, BLOCK, NUM_BLOCKS, torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    t = sum(c.query_len for c in cases)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    positions = torch.cat([torch.arange(c.context_len, c.context_len + c.query_len) for c in cases])
    stack = model.compiled_stack
    out = {}
    base = _caches(cfg)
    with torch.inference_mode():
        for name, use in (("loop", None), ("stack", stack)):
            caches = [(k.clone(), v.clone()) for k, v in base]
            model.compiled_stack = use
            out[name] = (model(ids, positions, caches, meta), caches)
    model.compiled_stack = stack
    return out


@pytest.mark.parametrize("cases", [MIXED, DECODES_ONLY, PREFILLS_ONLY, [SeqCase(0, 1)], [SeqCase(200, 97)]],
                         ids=["mixed", "decodes", "prefills", "one_token", "long_chunk"])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 6, 2), (128, 4, 4), (64, 9, 3)])
def test_stack_is_bit_identical_to_the_python_loop(cases, head_dim, heads, kv_heads):
    cfg = _config(head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    model = _model(cfg)
    assert isinstance(model.compiled_stack, CompiledDecoderStack)
    out = _run_both(model, cfg, cases)
    (h_loop, c_loop), (h_stack, c_stack) = out["loop"], out["stack"]
    assert h_stack.shape == (sum(c.query_len for c in cases), cfg.hidden_size)
    assert torch.equal(h_stack, h_loop)
    assert h_stack.abs().max().item() > 0.1            # not a trivially equal output
    for (k1, v1), (k2, v2) in zip(c_loop, c_stack):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_stack_runs_when_and_only_when_it_applies():
    cfg = _config()
    model = _model(cfg)
    calls = []
    op = model.compiled_stack._op
    model.compiled_stack._op = lambda *a: calls.append(1) or op(*a)
    meta, _ = build_metadata([SeqCase(3, 2)], BLOCK, NUM_BLOCKS, torch.Generator().manual_seed(0))
    ids, pos = torch.tensor([5, 6]), torch.tensor([3, 4])
    with torch.inference_mode():
        model(ids, pos, _caches(cfg), meta)
        assert calls == [1]
        model(ids, pos, _caches(cfg, torch.float32), meta)   # a float32 cache: the Python loop
        assert calls == [1]


@pytest.mark.parametrize("what,arch,over", [
    ("attention biases", "LlamaForCausalLM", {"attention_bias": True}),
    ("mlp biases", "LlamaForCausalLM", {"mlp_bias": True}),
    ("qwen2 q/k/v biases", "Qwen2ForCausalLM", {"model_type": "qwen2"}),
    ("qwen3 q/k norms and biases", "Qwen3ForCausalLM", {"model_type": "qwen3", "attention_bias": True}),
])
def test_stack_covers_biases_and_qk_norms_bit_identically(what, arch, over):
    """Biased projections and Qwen3's per-head q/k norms run in the op too, each bias added where
    the packed kernel adds it and the norms as RMSNorm's torch ops; without them (empty lists) the
    same op gives another answer, so they are applied."""
    cfg = _config(arch, **over)
    model = _model(cfg)
    stack = model.compiled_stack
    assert isinstance(stack, CompiledDecoderStack), unsupported_reason(model)
    biased = [name for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norms", "k_norms")
              if getattr(stack, name)]
    assert biased == {"attention biases": ["qkv_bias", "o_bias"], "mlp biases": ["gate_up_bias", "down_bias"],
                      "qwen2 q/k/v biases": ["qkv_bias"],
                      "qwen3 q/k norms and biases": ["qkv_bias", "o_bias", "q_norms", "k_norms"]}[what]
    out = _run_both(model, cfg, MIXED)
    (h_loop, c_loop), (h_stack, c_stack) = out["loop"], out["stack"]
    assert torch.equal(h_stack, h_loop)
    for (k1, v1), (k2, v2) in zip(c_loop, c_stack):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for names in ([n] if n not in ("q_norms", "k_norms") else ["q_norms", "k_norms"] for n in biased if n != "k_norms"):
        for name in names:
            setattr(stack, name, [])
        h_without = _run_both(model, cfg, MIXED)["stack"][0]
        assert not torch.allclose(h_without.float(), h_stack.float(), atol=0.05), names
        for name in names:
            setattr(stack, name, getattr(CompiledDecoderStack(model), name))


@pytest.mark.parametrize("what,arch,over", [
    ("odd head dim", "LlamaForCausalLM", {"head_dim": 32}),
])
def test_models_it_does_not_cover_keep_the_python_loop(what, arch, over):
    cfg = _config(arch, **over)
    model = _model(cfg)
    assert model.compiled_stack is None, what
    assert unsupported_reason(model) is not None
    with pytest.raises(ValueError, match="cannot run this model"):
        CompiledDecoderStack(model)


def test_torch_backend_keeps_the_python_loop():
    model = _model(_config(), backend="torch")
    assert model.compiled_stack is None
    assert "cpu attention backend" in unsupported_reason(model) or "not the fused" in unsupported_reason(model)


def test_op_refuses_inconsistent_inputs():
    cfg = _config()
    model = _model(cfg)
    s = model.compiled_stack
    meta, _ = build_metadata([SeqCase(0, 2)], BLOCK, NUM_BLOCKS, torch.Generator().manual_seed(0))
    caches = _caches(cfg)
    x = torch.randn(2, cfg.hidden_size).bfloat16()
    with pytest.raises(RuntimeError, match="one tensor per layer"):
        torch.ops.sluice.decoder_stack(
            x, torch.arange(2), s.input_norms, s.qkv[:-1], s.o_proj, s.post_norms, s.gate_up, s.down,
            [k for k, _ in caches], [v for _, v in caches], meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
            meta.block_tables, s.rotary.cos, s.rotary.sin, s.final_norm, [], [], [], [], [], [], s.num_heads, s.head_dim,
            s.intermediate_size, s.eps, s.scale)
    with pytest.raises(RuntimeError, match="bias list"):
        torch.ops.sluice.decoder_stack(
            x, torch.arange(2), s.input_norms, s.qkv, s.o_proj, s.post_norms, s.gate_up, s.down,
            [k for k, _ in caches], [v for _, v in caches], meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
            meta.block_tables, s.rotary.cos, s.rotary.sin, s.final_norm, [None], [], [], [], [], [], s.num_heads,
            s.head_dim, s.intermediate_size, s.eps, s.scale)
    bad = torch.full_like(meta.slot_mapping, NUM_BLOCKS * BLOCK)     # past the cache
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.sluice.decoder_stack(
            x, torch.arange(2), s.input_norms, s.qkv, s.o_proj, s.post_norms, s.gate_up, s.down,
            [k for k, _ in caches], [v for _, v in caches], bad, meta.query_start_loc, meta.seq_lens,
            meta.block_tables, s.rotary.cos, s.rotary.sin, s.final_norm, [], [], [], [], [], [], s.num_heads, s.head_dim,
            s.intermediate_size, s.eps, s.scale)


MODEL = Path.home() / ".cache" / "sluice" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not MODEL.exists(), reason="default model not downloaded")
def test_default_model_runs_as_one_call_bit_identical():
    from sluice.model.loader import load_model, load_model_config

    cfg = load_model_config(MODEL)
    model = load_model(MODEL, cfg, torch.bfloat16, create_backend("cpu"))
    assert isinstance(model.compiled_stack, CompiledDecoderStack)
    (h_loop, c_loop), (h_stack, c_stack) = _run_both(model, cfg, MIXED).values()
    assert torch.equal(h_stack, h_loop)
    assert all(torch.equal(a, b) for (k1, v1), (k2, v2) in zip(c_loop, c_stack) for a, b in ((k1, k2), (v1, v2)))
