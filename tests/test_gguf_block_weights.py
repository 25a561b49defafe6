"""A GGUF's Q4_1 and Q8_0 linear weights kept in their blocks (`--weight-format native`): the packed
layout, the kernels' dequantization and the model that computes from them.

The claim is bit-identity: a linear computed from the blocks gives the bits the same linear gives
from the bf16 weights those blocks dequantize to (gguf's `d * q + m` / `q * d` in float32, rounded
to bf16), on every path (AMX tiles, AVX-512 vectors), at every row count and thread count. The
reference for the dequantization is gguf's own numpy code; the reference for the products is the
bf16 kernel, which the rest of the suite checks against torch and transformers.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from sluice.attention.cpu import extension
from sluice.model.packed_linear import PackedLinear, block_values, pack_blocks, pack_weight

from test_kernels_cpu import MODEL, linear_path  # noqa: F401  (the fixture: AMX and vector paths)

pytestmark = [
    pytest.mark.skipif(bool(extension.missing_cpu_flags()), reason=f"CPU lacks {extension.missing_cpu_flags()}"),
]


@pytest.fixture(scope="module", autouse=True)
def _ext():
    extension.load_extension()
    if not torch.ops.sluice.linear_blocks_supported():
        pytest.skip("this CPU's kernel set computes from bf16 packed weights only (AVX2)")


def _blocks(n: int, k: int, seed: int, kind: str = "q4_1") -> torch.Tensor:
    """Random blocks [n, k / 32, bytes] with scales like a real file's (Q4_1: d > 0, m < 0)."""
    g = torch.Generator().manual_seed(seed)
    kb = k // 32
    d = (torch.rand(n, kb, generator=g) * 0.02 + 1e-4).half().view(torch.uint8).reshape(n, kb, 2)
    if kind == "q8_0":
        return torch.cat([d, torch.randint(0, 256, (n, kb, 32), generator=g, dtype=torch.uint8)], dim=2)
    m = (-torch.rand(n, kb, generator=g) * 0.1).half().view(torch.uint8).reshape(n, kb, 2)
    return torch.cat([d, m, torch.randint(0, 256, (n, kb, 16), generator=g, dtype=torch.uint8)], dim=2)


_QTYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def dequantize_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] gguf dequantizes the blocks to: the reference."""
    n = blocks.shape[0]
    return torch.from_numpy(dequantize(blocks.numpy().reshape(n, -1), _QTYPES[kind]).reshape(n, -1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("kind,qtype", [("q4_1", GGMLQuantizationType.Q4_1), ("q8_0", GGMLQuantizationType.Q8_0)])
def test_dequantize_matches_gguf(kind, qtype):
    """block_values reads d, m and q where gguf does: its weights, computed as gguf computes them."""
    b = _blocks(48, 96, 1, kind)
    want = dequantize(b.numpy().reshape(48, -1), qtype).reshape(48, 96)
    d, m, q = block_values(kind, b)
    got = q.reshape(48, 3, 32).float() * d.float().reshape(48, 3, 1)
    if m is not None:
        got = got + m.float().reshape(48, 3, 1)
    assert np.array_equal(got.reshape(48, 96).numpy(), want)


def test_pack_layout_by_hand():
    """One vector block: the 16 columns' d (Q4_1: and m), then per k pair the q of lane i =
    (column i / 2, k parity i % 2): Q4_1 lanes 0-15 in low nibbles, 16-31 in high; Q8_0 a byte each."""
    b = _blocks(16, 32, 2)
    d, m, q = block_values("q4_1", b)
    packed = pack_blocks("q4_1", b)
    assert packed.dtype == torch.uint8 and packed.numel() == 320
    assert torch.equal(packed[:32].view(torch.float16), d[:, 0])
    assert torch.equal(packed[32:64].view(torch.float16), m[:, 0])
    for p in range(16):
        for i in range(16):
            byte = int(packed[64 + 16 * p + i])
            assert byte & 0xF == int(q[i // 2, 2 * p + i % 2])
            assert byte >> 4 == int(q[8 + i // 2, 2 * p + i % 2])
    b = _blocks(16, 32, 3, "q8_0")
    d, m, q = block_values("q8_0", b)
    packed = pack_blocks("q8_0", b)
    assert m is None and packed.dtype == torch.int8 and packed.numel() == 544
    assert torch.equal(packed[:32].view(torch.float16), d[:, 0])
    for p in range(16):
        for i in range(32):
            assert int(packed[32 + 32 * p + i]) == int(q[i // 2, 2 * p + i % 2])


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 96), (960, 576), (576, 1536)])
def test_unpack_gives_the_bf16_packed_weight(n, k, kind):
    b = _blocks(n, k, n + k, kind)
    w = dequantize_blocks(kind, b).bfloat16()
    got = torch.ops.sluice.linear_unpack_blocks(pack_blocks(kind, b), n, k)
    assert torch.equal(_bits(got), _bits(pack_weight(w)))


# Row counts across every way a call runs: one and few rows (AMX: B tiles dequantized per k step
# up to two row tiles), past two row tiles (the group dequantized into the thread's buffer), and
# from two 96-row blocks on (groups dealt; the vector path per row block).
ROWS = [1, 2, 5, 6, 7, 16, 31, 32, 33, 64, 100, 191, 192, 200, 513]


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k,silu_mul", [(960, 576, False), (576, 1536, False), (48, 64, False), (80, 96, False),
                                          (3072, 576, True), (96, 64, True)])
def test_linear_from_blocks_gives_the_bf16_bits(n, k, silu_mul, kind, linear_path):
    b = _blocks(n, k, 7 * n + k, kind)
    w = dequantize_blocks(kind, b).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16() if n == 80 else None
    ref = PackedLinear(w, bias, silu_mul=silu_mul)
    lin = PackedLinear(w, bias, silu_mul=silu_mul, blocks=(kind, b))
    assert (ref.format, lin.format) == ("bf16", kind)
    # 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight against bf16's 2
    assert lin.packed.numel() * 16 == ref.packed.numel() * (10 if kind == "q4_1" else 17)
    g = torch.Generator().manual_seed(k)
    for m in ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        assert torch.equal(_bits(lin(x)), _bits(ref(x))), f"{m} rows"


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 9, 40, 300])
def test_block_bits_do_not_depend_on_threads(m, kind, linear_path):
    b = _blocks(960, 576, 3, kind)
    lin = PackedLinear(dequantize_blocks(kind, b).bfloat16(), None, blocks=(kind, b))
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
    w = dequantize_blocks("q4_1", b).bfloat16()
    wrong = b.clone()
    wrong[5, 1, 4] ^= 0x3  # two weights of row 5 changed
    with caplog.at_level(logging.WARNING):
        lin = PackedLinear(w, None, blocks=("q4_1", wrong))
    assert lin.format == "bf16" and "do not dequantize" in caplog.text
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(_bits(lin(x)), _bits(PackedLinear(w, None)(x)))


def test_bad_block_inputs_are_refused():
    b = _blocks(32, 64, 5)
    packed = pack_blocks("q4_1", b)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="GGUF blocks"):
        torch.ops.sluice.linear_bf16(x, packed[:-1], 32, None)
    with pytest.raises(RuntimeError, match="K of 32"):
        torch.ops.sluice.linear_bf16(torch.randn(2, 48).bfloat16(), packed, 32, None)
    with pytest.raises(RuntimeError, match="GGUF blocks"):   # Q4_1 bytes read as Q8_0: the size is wrong
        torch.ops.sluice.linear_bf16(x, packed.view(torch.int8), 32, None)
    with pytest.raises(ValueError, match="q4_1 blocks must be"):
        pack_blocks("q4_1", b[:, :, :18])
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_blocks("q4_1", b[:8])
    with pytest.raises(ValueError, match="unknown block format"):
        pack_blocks("q5_0", b)


@pytest.fixture(scope="module")
def models():
    from sluice.attention import create_backend
    from sluice.model.loader import load_model, load_model_config

    if not MODEL.exists():
        pytest.skip("default model not downloaded")
    cfg = load_model_config(MODEL)
    return cfg, {fmt: load_model(MODEL, cfg, torch.bfloat16, create_backend("cpu"), weight_format=fmt)
                 for fmt in ("native", "bf16")}


def test_smollm2_linears_read_the_files_blocks(models):
    _, by_format = models
    packed = {fmt: [m for m in model.modules() if isinstance(m, PackedLinear)] for fmt, model in by_format.items()}
    # 30 layers x (qkv, o, gate/up, down): every one Q4_1 in the file; the tied LM head reads the
    # Q8_0 embeddings' blocks (the embedding lookup keeps its bf16 copy).
    formats = [m.format for m in packed["native"]]
    assert (formats.count("q4_1"), formats.count("q8_0"), len(formats)) == (120, 1, 121)
    assert by_format["native"].lm_head.format == "q8_0"
    assert {m.format for m in packed["bf16"]} == {"bf16"}
    q4 = [m for m in packed["native"] if m.format == "q4_1"]
    assert sum(m.packed.numel() for m in q4) * 8 == 5 * sum(m.in_features * m.out_features for m in q4)


def test_auto_keeps_blocks_where_the_linears_run_on_amx():
    from sluice.model.loader import keeps_blocks

    for amx in (False, True):
        assert keeps_blocks("native", amx) and not keeps_blocks("bf16", amx)
        assert keeps_blocks("auto", amx) is amx
    with pytest.raises(ValueError, match="weight_format must be one of"):
        keeps_blocks("q4", True)


def test_smollm2_default_format_follows_the_linears_path():
    """The default ("auto") on this machine: the file's blocks where AMX computes the linears,
    bf16 on the vector path."""
    from sluice.attention import create_backend
    from sluice.model.loader import load_model, load_model_config

    if not MODEL.exists():
        pytest.skip("default model not downloaded")
    model = load_model(MODEL, load_model_config(MODEL), torch.bfloat16, create_backend("cpu"))
    assert model.lm_head.format == ("q8_0" if torch.ops.sluice.linear_amx_enabled() else "bf16")


@pytest.mark.parametrize("tokens", [7, 96, 200])
def test_smollm2_forward_is_bit_identical_in_either_format(models, tokens):
    """The whole model (the C++ decoder stack, paged attention, the LM head) on a prompt: the
    same logits, bit for bit (7 tokens: B tiles dequantized per k step on AMX; 96: per group;
    200: prefill-sized, on the vector path dealt in row blocks that each dequantize their groups)."""
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
