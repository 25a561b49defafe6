"""A GGUF's Q4_1 linear weights kept 4-bit (`--weight-format native`): the packed layout, the
kernels' dequantization and the model that computes from them.

The claim is bit-identity: a linear computed from Q4_1 blocks gives the bits the same linear gives
from the bf16 weights those blocks dequantize to (gguf's `d * q + m` in float32, rounded to bf16),
on every path (AMX tiles, AVX-512 vectors), at every row count and thread count. The reference for
the dequantization is gguf's own numpy code; the reference for the products is the bf16 kernel,
which the rest of the suite checks against torch and transformers.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sluice.attention.cpu import extension
from sluice.model.packed_linear import PackedLinear, dequantize_q4_1, pack_q4_1, q4_1_values

from test_kernels_cpu import MODEL, linear_path  # noqa: F401  (the fixture: AMX and vector paths)

pytestmark = [
    pytest.mark.skipif(bool(extension.missing_cpu_flags()), reason=f"CPU lacks {extension.missing_cpu_flags()}"),
]


@pytest.fixture(scope="module", autouse=True)
def _ext():
    extension.load_extension()
    if not torch.ops.sluice.linear_q4_supported():
        pytest.skip("this CPU's kernel set computes from bf16 packed weights only (AVX2)")


def _blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random Q4_1 blocks [n, k / 32, 20] with scales like a real file's (d > 0, m < 0)."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    d = (torch.rand(n, kb, generator=g) * 0.02 + 1e-4).half()
    m = (-torch.rand(n, kb, generator=g) * 0.1).half()
    qs = torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)
    return torch.cat([d.view(torch.uint8).reshape(n, kb, 2), m.view(torch.uint8).reshape(n, kb, 2), qs], dim=2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_dequantize_matches_gguf():
    b = _blocks(48, 96, 1)
    want = dequantize(b.numpy().reshape(48, -1), GGMLQuantizationType.Q4_1).reshape(48, 96)
    assert np.array_equal(dequantize_q4_1(b).numpy(), want)


def test_pack_layout_by_hand():
    """One vector block: d and m of the 16 columns, then per k pair the byte whose nibbles are
    column i / 2 (low) and column 8 + i / 2 (high) at k parity i % 2."""
    b = _blocks(16, 32, 2)
    d, m, q = q4_1_values(b)
    packed = pack_q4_1(b)
    assert packed.dtype == torch.uint8 and packed.numel() == 320
    assert torch.equal(packed[:32].view(torch.float16), d[:, 0])
    assert torch.equal(packed[32:64].view(torch.float16), m[:, 0])
    for p in range(16):
        for i in range(16):
            byte = int(packed[64 + 16 * p + i])
            assert byte & 0xF == int(q[i // 2, 2 * p + i % 2])
            assert byte >> 4 == int(q[8 + i // 2, 2 * p + i % 2])


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 96), (960, 576), (576, 1536)])
def test_unpack_gives_the_bf16_packed_weight(n, k):
    from sluice.model.packed_linear import pack_weight

    b = _blocks(n, k, n + k)
    w = dequantize_q4_1(b).bfloat16()
    got = torch.ops.sluice.linear_q4_unpack(pack_q4_1(b), n, k)
    assert torch.equal(_bits(got), _bits(pack_weight(w)))


# Row counts across every way a call runs: one and few rows (AMX: B tiles dequantized per k step
# up to two row tiles), past two row tiles (the group dequantized into the thread's buffer), and
# from two 96-row blocks on (groups dealt; the vector path per row block).
ROWS = [1, 2, 5, 6, 7, 16, 31, 32, 33, 64, 100, 191, 192, 200, 513]


@pytest.mark.parametrize("n,k,silu_mul", [(960, 576, False), (576, 1536, False), (48, 64, False), (80, 96, False),
                                          (3072, 576, True), (96, 64, True)])
def test_linear_from_q4_1_gives_the_bf16_bits(n, k, silu_mul, linear_path):
    b = _blocks(n, k, 7 * n + k)
    w = dequantize_q4_1(b).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16() if n == 80 else None
    ref = PackedLinear(w, bias, silu_mul=silu_mul)
    q4 = PackedLinear(w, bias, silu_mul=silu_mul, q4_1=b)
    assert (ref.format, q4.format) == ("bf16", "q4_1")
    assert q4.packed.numel() * 8 == ref.packed.numel() * 5     # 0.625 bytes a weight against 2
    g = torch.Generator().manual_seed(k)
    for m in ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        assert torch.equal(_bits(q4(x)), _bits(ref(x))), f"{m} rows"


@pytest.mark.parametrize("m", [1, 9, 40, 300])
def test_q4_1_bits_do_not_depend_on_threads(m, linear_path):
    b = _blocks(960, 576, 3)
    lin = PackedLinear(dequantize_q4_1(b).bfloat16(), None, q4_1=b)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).bfloat16()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(prev)
    assert torch.equal(_bits(one), _bits(two))


def test_blocks_that_are_not_the_weight_stay_bf16(caplog):
    b = _blocks(64, 64, 4)
    w = dequantize_q4_1(b).bfloat16()
    wrong = b.clone()
    wrong[5, 1, 4] ^= 0x3  # two weights of row 5 changed
    with caplog.at_level(logging.WARNING):
        lin = PackedLinear(w, None, q4_1=wrong)
    assert lin.format == "bf16" and "do not dequantize" in caplog.text
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(_bits(lin(x)), _bits(PackedLinear(w, None)(x)))


def test_bad_q4_1_inputs_are_refused():
    b = _blocks(32, 64, 5)
    packed = pack_q4_1(b)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="Q4_1"):
        torch.ops.sluice.linear_bf16(x, packed[:-1], 32, None)
    with pytest.raises(RuntimeError, match="K of 32"):
        torch.ops.sluice.linear_bf16(torch.randn(2, 48).bfloat16(), packed, 32, None)
    with pytest.raises(ValueError, match="Q4_1 blocks must be"):
        pack_q4_1(b[:, :, :18])
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_q4_1(b[:8])


@pytest.fixture(scope="module")
def models():
    from sluice.attention import create_backend
    from sluice.model.loader import load_model, load_model_config

    if not MODEL.exists():
        pytest.skip("default model not downloaded")
    cfg = load_model_config(MODEL)
    return cfg, {fmt: load_model(MODEL, cfg, torch.bfloat16, create_backend("cpu"), weight_format=fmt)
                 for fmt in ("native", "bf16")}


def test_smollm2_linears_read_the_files_q4_1_blocks(models):
    _, by_format = models
    packed = {fmt: [m for m in model.modules() if isinstance(m, PackedLinear)] for fmt, model in by_format.items()}
    # 30 layers x (qkv, o, gate/up, down): every one Q4_1 in the file; the tied LM head (Q8_0
    # embeddings) stays bf16.
    assert [m.format for m in packed["native"]].count("q4_1") == 120
    assert [m.format for m in packed["bf16"]].count("q4_1") == 0
    q4 = [m for m in packed["native"] if m.format == "q4_1"]
    assert sum(m.packed.numel() for m in q4) * 8 == 5 * sum(m.in_features * m.out_features for m in q4)


@pytest.mark.parametrize("tokens", [7, 96])
def test_smollm2_forward_is_bit_identical_in_either_format(models, tokens):
    """The whole model (the C++ decoder stack, paged attention, the LM head) on a prompt: the
    same logits, bit for bit (7 tokens: B tiles dequantized per k step on AMX; 96: per group)."""
    from test_attention_backend import SeqCase, build_metadata

    cfg, by_format = models
    ids = torch.randint(100, 40000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    logits = {}
    for fmt, model in by_format.items():
        caches = [(torch.zeros(16, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16),
                   torch.zeros(16, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16))
                  for _ in range(cfg.num_hidden_layers)]
        meta, _ = build_metadata([SeqCase(0, tokens)], 16, 16, torch.Generator().manual_seed(1))
        with torch.inference_mode():
            logits[fmt] = model.compute_logits(model(ids, torch.arange(tokens), caches, meta))
    assert torch.equal(logits["native"], logits["bf16"])
