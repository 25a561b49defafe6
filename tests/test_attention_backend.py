"""Paged attention backends against a dense causal attention over contiguous K/V.

`check_paged_attention` is the reusable checker: it lays random prior context out in a paged
cache through shuffled, non-contiguous block tables, runs one backend call over a flattened
batch of decodes and prefill chunks, and compares the output (and the K/V the backend wrote
into the cache) with float64 attention computed on the unpaged tensors. Every backend in
`sluice.attention.available_backends()` is checked, so a new kernel is covered by registering it.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sluice.attention import AttentionMetadata, available_backends, create_backend


@dataclass(frozen=True)
class SeqCase:
    context_len: int   # tokens already in the cache before this step
    query_len: int     # new tokens of this step (1: a decode)


# Decodes come first, as the metadata contract requires; a one-token chunk after the decodes is
# still a valid prefill entry. Context lengths straddle block boundaries for both block sizes.
MIXED = [SeqCase(37, 1), SeqCase(1, 1), SeqCase(64, 1), SeqCase(100, 1),
         SeqCase(0, 23), SeqCase(48, 16), SeqCase(5, 40), SeqCase(30, 1), SeqCase(0, 1), SeqCase(95, 33)]
DECODES_ONLY = [SeqCase(n, 1) for n in (0, 15, 16, 17, 63, 129)]
PREFILLS_ONLY = [SeqCase(0, 70), SeqCase(0, 2), SeqCase(31, 2)]

# float32: the torch reference is within 1e-6 of float64 (accumulation order only); 1e-5 leaves
# a margin for kernels that accumulate differently. bfloat16: q/k/v and the output carry 8
# mantissa bits (one ulp is 0.4-0.8% of a value); the reference lands within ~0.01 of float64
# on outputs up to ~2, so 2e-2 allows a few ulps without hiding a wrong mask or a wrong slot
# (those are off by O(1), the garbage in unowned blocks is 10x larger still).
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def build_metadata(cases: list[SeqCase], block_size: int, num_blocks: int,
                   generator: torch.Generator) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """Metadata for `cases` with block ids drawn from a shuffled pool; returns each sequence's
    flat cache slots for positions 0 .. context_len + query_len - 1."""
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables, seq_slots = [], []
    for c in cases:
        n = c.context_len + c.query_len
        blocks = [pool.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        pos = torch.arange(n)
        seq_slots.append(torch.tensor(blocks, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(cases), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    qlens = [c.query_len for c in cases]
    seq_lens = [c.context_len + c.query_len for c in cases]
    qsl = torch.zeros(len(cases) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    num_decodes = 0
    while num_decodes < len(cases) and qlens[num_decodes] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        slot_mapping=torch.cat([s[c.context_len:] for s, c in zip(seq_slots, cases)]),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        num_decodes=num_decodes,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        query_lens_list=qlens,
        seq_lens_list=seq_lens,
    )
    return meta, seq_slots


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of the last q.shape[0] positions of one sequence over all of k/v.

    q: [Q, H, D], k/v: [L, KVH, D] -> [Q, H, D]."""
    qlen, num_heads, _ = q.shape
    ctx = k.shape[0] - qlen
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)                          # [L, H, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale           # [H, Q, L]
    allowed = torch.arange(k.shape[0])[None, :] <= (torch.arange(qlen)[:, None] + ctx)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def check_paged_attention(backend, cases: list[SeqCase], *, num_heads: int, num_kv_heads: int, head_dim: int,
                          block_size: int, dtype: torch.dtype, atol: float, rtol: float, seed: int = 0,
                          device: str = "cpu") -> None:
    """Assert `backend.forward` equals dense causal attention for one batch of `cases`."""
    g = torch.Generator().manual_seed(seed)
    total_blocks = sum(-(-(c.context_len + c.query_len) // block_size) for c in cases)
    num_blocks = total_blocks + 7                        # spare blocks hold garbage nobody may read
    meta, seq_slots = build_metadata(cases, block_size, num_blocks, g)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    # Garbage of a different scale everywhere, so reading an unowned or stale slot shows.
    k_cache = (randn(num_blocks, block_size, num_kv_heads, head_dim) * 10).to(device)
    v_cache = (randn(num_blocks, block_size, num_kv_heads, head_dim) * 10).to(device)
    full_k = [randn(c.context_len + c.query_len, num_kv_heads, head_dim) for c in cases]
    full_v = [randn(c.context_len + c.query_len, num_kv_heads, head_dim) for c in cases]
    full_q = [randn(c.query_len, num_heads, head_dim) for c in cases]
    for c, slots, kk, vv in zip(cases, seq_slots, full_k, full_v):
        ctx = slots[:c.context_len].to(device)
        k_cache.view(-1, num_kv_heads, head_dim)[ctx] = kk[:c.context_len].to(device)
        v_cache.view(-1, num_kv_heads, head_dim)[ctx] = vv[:c.context_len].to(device)

    q = torch.cat(full_q).to(device)                                                  # [T, H, D]
    k_new = torch.cat([kk[c.context_len:] for c, kk in zip(cases, full_k)]).to(device)  # [T, KVH, D]
    v_new = torch.cat([vv[c.context_len:] for c, vv in zip(cases, full_v)]).to(device)
    scale = head_dim ** -0.5
    dev_meta = AttentionMetadata(**{f: (getattr(meta, f).to(device) if isinstance(getattr(meta, f), torch.Tensor)
                                        else getattr(meta, f)) for f in meta.__dataclass_fields__})
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, dev_meta, scale).cpu()

    assert out.shape == q.shape and out.dtype == dtype
    starts = meta.query_start_loc.tolist()
    for i, c in enumerate(cases):
        expected = dense_causal_attention(full_q[i], full_k[i], full_v[i], scale)
        got = out[starts[i]:starts[i + 1]].double()
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol,
                                   msg=lambda m, i=i, c=c: f"sequence {i} {c}: {m}")
    # The new tokens' K/V must now be in the cache at their slots.
    k_flat = k_cache.view(-1, num_kv_heads, head_dim).cpu()
    v_flat = v_cache.view(-1, num_kv_heads, head_dim).cpu()
    assert torch.equal(k_flat[meta.slot_mapping], k_new.cpu())
    assert torch.equal(v_flat[meta.slot_mapping], v_new.cpu())


@pytest.fixture(params=available_backends())
def backend(request):
    try:
        return create_backend(request.param)
    except RuntimeError as e:  # e.g. a compiled backend this CPU cannot run
        pytest.skip(f"attention backend {request.param!r} is unavailable here: {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("cases", [MIXED, DECODES_ONLY, PREFILLS_ONLY], ids=["mixed", "decodes", "prefills"])
def test_paged_attention_matches_dense(backend, cases, heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    check_paged_attention(backend, cases, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                          block_size=block_size, dtype=dtype, **TOLERANCES[dtype])


def test_auto_backend_is_registered():
    assert "torch" in available_backends()
    assert create_backend("auto").name in available_backends()
