"""The compiled CPU paged-attention backend ("cpu") against the references.

- `check_paged_attention` (from test_attention_backend.py): float64 dense causal attention over
  the unpaged K/V, plus the cache contents after the write, on shuffled block tables. Here with
  GQA ratios 1/3/4, head_dim 64 and 128, block sizes 16/32, and batches shaped to reach every path
  of the kernel: decodes grouped per sequence (all kv heads in one work item) and per kv head,
  prefill chunks split into query tiles, keys in several 64-key chunks with partial tails.
- `TorchPagedAttention` at SmolLM2's real step shape (32 decodes of 1-2k context plus a 500-token
  chunk after a prefix), outputs and caches compared directly.
- The real model: greedy generation through `LLM(attention_backend="cpu")` equals "torch".

These run the kernel set this CPU builds (AVX-512 BF16 or AVX2; test_kernel_sets.py runs them
again on the AVX2 set where the machine defaults to the other). Tolerances: float32 1e-5 (atol and
rtol), the shared checker's: the kernel sums in a different order (64- or 32-key chunks, online
softmax, a polynomial exp2 with relative error < 1e-8), which moves
results by ~1e-6; a wrong mask, slot or scale moves them by O(0.1). bfloat16 2e-2: q/k/v and the
output carry 8 mantissa bits (an output of ~1 is rounded by up to 4e-3) and, like torch's CPU
flash attention, the AVX-512 kernel rounds the softmax weights to bf16 before multiplying by V, so a few
ulps of difference are expected; the cache's garbage is 10x larger than real values, so reading
a wrong slot still fails by far.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from sluice.attention import AttentionMetadata, create_backend
from sluice.attention.cpu import CpuPagedAttention, extension
from sluice.attention.torch_ref import TorchPagedAttention
from test_attention_backend import TOLERANCES, SeqCase, build_metadata, check_paged_attention

# Only a CPU without the instructions skips; on a capable machine a failed build or self-check fails.
pytestmark = pytest.mark.skipif(bool(extension.missing_cpu_flags()),
                                reason=f"CPU lacks {extension.missing_cpu_flags()}")

# Decodes first (as the runner orders them), then chunks with and without prefixes. Contexts
# cross 64-key chunk and block boundaries; query lengths cover one tile, several tiles and a
# partial last tile for every group size (a tile is 96 // group tokens).
MANY = ([SeqCase(c, 1) for c in (0, 1, 15, 31, 32, 33, 63, 64, 65, 100, 127, 128, 255, 300)]
        + [SeqCase(0, 40), SeqCase(70, 100), SeqCase(5, 1), SeqCase(31, 17), SeqCase(200, 3), SeqCase(60, 69)])
# Two long decodes: enough work for two threads but too few sequences to give each one item, so
# (with two or more threads) each kv head is an item.
FEW_DECODES = [SeqCase(2000, 1), SeqCase(2100, 1)]
LONG_CHUNK = [SeqCase(96, 1), SeqCase(0, 130), SeqCase(333, 77)]
HEADS = {"mha": (4, 4), "gqa3": (9, 3), "gqa4": (8, 2)}


@pytest.fixture(scope="module")
def cpu():
    return create_backend("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
@pytest.mark.parametrize("cases", [MANY, FEW_DECODES, LONG_CHUNK], ids=["many", "few_decodes", "long_chunk"])
def test_matches_dense_attention(cpu, cases, heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    check_paged_attention(cpu, cases, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                          block_size=block_size, dtype=dtype, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_dim_128(cpu, dtype):
    check_paged_attention(cpu, MANY[::3] + LONG_CHUNK[1:], num_heads=8, num_kv_heads=2, head_dim=128,
                          block_size=16, dtype=dtype, seed=1, **TOLERANCES[dtype])


@pytest.fixture
def num_threads():
    """Sets torch's intra-op thread count for one test."""
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
def test_matches_dense_attention_at_any_thread_count(cpu, num_threads, threads):
    num_threads(threads)
    check_paged_attention(cpu, MANY + FEW_DECODES, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                          dtype=torch.bfloat16, seed=2, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cases", [[SeqCase(250 + 3 * i, 1) for i in range(8)], [SeqCase(2000, 1)]],
                         ids=["8_decodes_of_256", "one_decode_of_2000"])
def test_a_small_decode_batch_gives_the_same_bits_on_one_thread_and_two(cpu, num_threads, cases, dtype):
    """How many threads a step's attention uses follows its total work (attention_common.h), so
    with the load; a light step of a few decodes (here 8 of ~256 keys, or one of 2,000: ~18k row
    keys, on two threads since session 46) must give every row the bits one thread gives it."""
    g = torch.Generator().manual_seed(5)
    num_blocks = sum(-(-(c.context_len + c.query_len) // 16) for c in cases) + 5
    meta, _ = build_metadata(cases, 16, num_blocks, g)
    t = sum(c.query_len for c in cases)
    caches = [torch.randn(num_blocks, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    q, k, v = (torch.randn(t, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    outs = []
    for threads in (1, 2):
        num_threads(threads)
        outs.append(cpu.forward(q, k, v, *[c.clone() for c in caches], meta, 0.125))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("others", [0, 40], ids=["alone", "beside_40_decodes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_query_row_does_not_depend_on_the_rows_beside_it(cpu, others, dtype):
    """Speculative decoding verifies drafts in one query and keeps the output of greedy decoding
    only if a position's attention is the same to the bit whether it is a decode or the first of
    7 verified tokens (other work items, row blocks and code paths around it)."""
    g = torch.Generator().manual_seed(7)
    cases = [SeqCase(100 + 37 * i, 1) for i in range(others)] + [SeqCase(300, 7)]
    num_blocks = sum(-(-(c.context_len + c.query_len) // 16) for c in cases) + 5
    meta7, _ = build_metadata(cases, 16, num_blocks, g)
    t7 = sum(c.query_len for c in cases)
    caches = [torch.randn(num_blocks, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    q, k, v = (torch.randn(t7, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    keep = torch.arange(t7) < t7 - 6  # the same step with only the first of the last sequence's 7 tokens
    qsl, seq_lens = meta7.query_start_loc.clone(), meta7.seq_lens.clone()
    qsl[-1] -= 6
    seq_lens[-1] -= 6
    meta1 = AttentionMetadata(slot_mapping=meta7.slot_mapping[keep], query_start_loc=qsl, seq_lens=seq_lens,
                              block_tables=meta7.block_tables, num_decodes=others + 1, max_query_len=1,
                              max_seq_len=int(seq_lens.max()), query_lens_list=[1] * (others + 1),
                              seq_lens_list=seq_lens.tolist())
    out7 = cpu.forward(q, k, v, *[c.clone() for c in caches], meta7, 0.125)
    out1 = cpu.forward(q[keep], k[keep], v[keep], *[c.clone() for c in caches], meta1, 0.125)
    assert torch.equal(out1, out7[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prompt_chunk_does_not_depend_on_the_chunks_beside_it(cpu, dtype):
    """A prompt chunk is split into query tiles whose size follows the step's other prompt work
    (larger beside a long chunk, on AMX: attention_common.h); its rows must come out the same to
    the bit either way, or a call's output would depend on what else its steps carried."""
    g = torch.Generator().manual_seed(11)
    cases = [SeqCase(500, 96), SeqCase(300, 512)]
    num_blocks = sum(-(-(c.context_len + c.query_len) // 16) for c in cases) + 5
    meta2, _ = build_metadata(cases, 16, num_blocks, g)
    t2 = sum(c.query_len for c in cases)
    caches = [torch.randn(num_blocks, 16, 3, 64, generator=g).to(dtype) for _ in range(2)]
    q, k, v = (torch.randn(t2, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
    keep = torch.arange(t2) < 96   # the same step with the first chunk alone
    meta1 = AttentionMetadata(slot_mapping=meta2.slot_mapping[keep], query_start_loc=meta2.query_start_loc[:2].clone(),
                              seq_lens=meta2.seq_lens[:1].clone(), block_tables=meta2.block_tables[:1],
                              num_decodes=0, max_query_len=96, max_seq_len=596, query_lens_list=[96],
                              seq_lens_list=[596])
    out2 = cpu.forward(q, k, v, *[c.clone() for c in caches], meta2, 0.125)
    out1 = cpu.forward(q[keep], k[keep], v[keep], *[c.clone() for c in caches], meta1, 0.125)
    assert torch.equal(out1, out2[keep])
    want = TorchPagedAttention().forward(q, k, v, *[c.clone() for c in caches], meta2, 0.125)
    torch.testing.assert_close(out2, want, **TOLERANCES[dtype])


def _random_step(cases, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c.context_len + c.query_len) // block_size) for c in cases) + 5
    meta, _ = build_metadata(cases, block_size, num_blocks, g)
    t = sum(c.query_len for c in cases)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    # q/k/v as the model passes them: strided views of one fused projection.
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (meta, q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
            v.view(t, num_kv_heads, head_dim), caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch_reference_at_smollm2_step_shape(cpu, dtype):
    g = torch.Generator().manual_seed(3)
    contexts = torch.randint(1000, 2048, (32,), generator=g).tolist()
    cases = [SeqCase(c, 1) for c in contexts] + [SeqCase(700, 500)]
    meta, q, k, v, caches = _random_step(cases, 9, 3, 64, 16, dtype, seed=4)
    ref_caches = [c.clone() for c in caches]
    want = TorchPagedAttention().forward(q, k, v, *ref_caches, meta, 0.125)
    got = cpu.forward(q, k, v, *caches, meta, 0.125)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches))


@pytest.mark.parametrize("spread", [4.0, 12.0, 40.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_peaked_scores_match_torch_reference(cpu, dtype, spread):
    """Scores whose maximum jumps between key chunks by less and by more than the kernels' lazy
    softmax slack (the AVX2 set moves its reference maximum only when a base-2 score exceeds it by
    more than 8):
    queries scaled so scores have a standard deviation of `spread` (1 for unit-variance data),
    from nearly flat to nearly one-hot; decodes and a prefill chunk over many key chunks. The
    reference is float64: a score's float32 rounding moves the output in proportion to the
    spread (torch's own float32 attention is off by 3e-5 at 40), so float32's tolerance grows
    with it; a skipped or wrong rescale moves outputs by O(0.1)."""
    cases = [SeqCase(c, 1) for c in (40, 300, 1000, 2047)] + [SeqCase(500, 90), SeqCase(0, 70)]
    meta, q, k, v, caches = _random_step(cases, 9, 3, 64, 16, dtype, seed=11)
    q = (q.float() * spread).to(dtype)
    want = TorchPagedAttention().forward(q.double(), k.double(), v.double(), *[c.double() for c in caches],
                                         meta, 0.125)
    got = cpu.forward(q, k, v, *caches, meta, 0.125)
    tol = TOLERANCES[dtype] if dtype == torch.bfloat16 else {"atol": 2e-6 * spread, "rtol": 2e-6 * spread}
    torch.testing.assert_close(got.double(), want, **tol)


def test_unsupported_layout_falls_back_to_reference(cpu, caplog):
    meta, q, k, v, caches = _random_step(MANY[:12], 4, 2, 64, 16, torch.float16, seed=5)
    ref_caches = [c.clone() for c in caches]
    backend = CpuPagedAttention()
    with caplog.at_level(logging.WARNING):
        got = backend.forward(q, k, v, *caches, meta, 0.125)
    want = TorchPagedAttention().forward(q, k, v, *ref_caches, meta, 0.125)
    assert torch.equal(got, want)
    assert "not supported" in caplog.text


def test_out_of_range_block_is_refused(cpu):
    meta, q, k, v, caches = _random_step(MANY[:4], 4, 2, 64, 16, torch.float32, seed=6)
    bad = AttentionMetadata(**{**meta.__dict__, "block_tables": meta.block_tables + 10_000})
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        cpu.forward(q, k, v, *caches, bad, 0.125)


def test_auto_prefers_cpu_and_falls_back_with_a_warning(monkeypatch, caplog):
    assert create_backend("auto").name == "cpu"
    monkeypatch.setattr(extension, "_state", {"error": extension.CpuAttentionUnavailable("no compiler")})
    with caplog.at_level(logging.WARNING):
        assert create_backend("auto").name == "torch"
    assert "no compiler" in caplog.text
    with pytest.raises(extension.CpuAttentionUnavailable):
        create_backend("cpu")


MODEL = Path.home() / ".cache" / "sluice" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "Once upon a time, in a small village,"]


@pytest.mark.skipif(not MODEL.exists(), reason="default model not downloaded")
def test_greedy_generation_matches_torch_backend(num_threads):
    from sluice import LLM, SamplingParams

    num_threads(1)  # the tokens do not depend on it; on a busy 2-core machine one thread is ~20x faster

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for name in ("torch", "cpu"):
        llm = LLM(str(MODEL), dtype="float32", attention_backend=name, max_model_len=512, kv_cache_tokens=2048)
        tokens[name] = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]
    assert all(len(t) == 16 for t in tokens["cpu"])
    assert tokens["cpu"] == tokens["torch"]
