"""The compiled bf16 linear, RMSNorm and rotary kernels (sluice/attention/cpu/{linear,fused}.cpp) against torch.

Reference: the product in float64 of the same bf16 inputs, rounded once to bf16. The kernel sums
in float32 (`vdpbf16ps`, or AMX's `tdpbf16ps` where the CPU has it), so its result may differ from
that by float32 rounding of a K-term sum plus one bf16 rounding: a relative error of ~2^-8 of the
output's scale. A wrong packing (a column or k pair swapped) moves results by O(1) of that scale, so
2e-2 separates the two. On AMX CPUs the linear tests run on both paths (the `linear_path` fixture).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from sluice.attention.cpu import extension
from sluice.model.layers import silu_and_mul
from sluice.model.packed_linear import PackedLinear, can_pack, gate_up_order, pack_linear_layers

pytestmark = pytest.mark.skipif(bool(extension.missing_cpu_flags()),
                                reason=f"CPU lacks {extension.missing_cpu_flags()}")


@pytest.fixture(scope="module", autouse=True)
def _ext():
    extension.load_extension()


def _amx_here() -> bool:
    return {"amx_tile", "amx_bf16"} <= extension.cpu_flags() and extension.kernel_isa() == "avx512_bf16"


@pytest.fixture(params=["amx", "vector"])
def linear_path(request):
    """Runs a test with the linears on AMX tiles and again on the vector (AVX-512 / AVX2) path;
    the AMX run is skipped where the CPU or the kernel set has no AMX."""
    was = torch.ops.sluice.linear_amx_enabled()
    want = request.param == "amx"
    if want and not _amx_here():
        pytest.skip("no AMX on this CPU (or the AVX2 kernel set runs)")
    assert torch.ops.sluice.linear_set_amx(want) == want
    yield request.param
    torch.ops.sluice.linear_set_amx(was)


def _ref(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    y = x.double() @ w.double().T
    if b is not None:
        y = y + b.double()
    return y


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item() + 1e-6
    err = (got.double() - want).abs().max().item()
    assert err <= 2e-2 * scale, f"max error {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 12, 13, 33, 130, 197, 300])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (64, 576), (80, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(m, n, k, bias, linear_path):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    layer = PackedLinear(w, b)
    got = layer(x)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    _close(got, _ref(x, w, b))


@pytest.mark.parametrize("m", [1, 6, 9, 40, 200])
@pytest.mark.parametrize("inter", [16, 32, 48, 1536])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_silu_mul_matches_unfused(m, inter, bias, linear_path):
    k = 576
    g = torch.Generator().manual_seed(m + inter)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * inter, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    want = silu_and_mul(_ref(x, w, b).bfloat16().double())
    got = PackedLinear(w, b, silu_mul=True)(x)
    assert got.shape == (m, inter)
    _close(got, want)


def test_gate_up_order_pairs_gate_and_up_rows():
    order = gate_up_order(2 * 48).tolist()
    assert order[:32] == list(range(32)) and order[32:64] == list(range(48, 80))
    assert order[64:80] == list(range(32, 48)) and order[80:] == list(range(80, 96))
    assert sorted(order) == list(range(96))


def test_strided_and_batched_inputs(linear_path):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(64, 128, generator=g) / 11).bfloat16()
    layer = PackedLinear(w, None)
    wide = torch.randn(7, 256, generator=g).bfloat16()
    x = wide[:, 64:192]                                  # rows 256 apart, not contiguous
    _close(layer(x), _ref(x, w, None))
    x3 = torch.randn(2, 3, 128, generator=g).bfloat16()
    got = layer(x3)
    assert got.shape == (2, 3, 64)
    _close(got.reshape(6, 64), _ref(x3.reshape(6, 128), w, None))
    assert layer(torch.empty(0, 128, dtype=torch.bfloat16)).shape == (0, 64)


def test_refuses_what_it_cannot_pack():
    assert not can_pack(torch.zeros(17, 64, dtype=torch.bfloat16))
    assert not can_pack(torch.zeros(16, 63, dtype=torch.bfloat16))
    assert not can_pack(torch.zeros(16, 64, dtype=torch.float32))
    with pytest.raises(ValueError):
        PackedLinear(torch.zeros(17, 64, dtype=torch.bfloat16), None)
    layer = PackedLinear(torch.zeros(16, 64, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError):
        layer(torch.zeros(2, 32, dtype=torch.bfloat16))  # wrong K


def test_pack_linear_layers_keeps_the_model_function():
    from sluice.model.llama import LlamaMLP

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 96)
            self.mlp = LlamaMLP(96, 160)
            self.odd = nn.Linear(96, 24)                 # 24 rows: not packable, stays
            self.head = nn.Linear(96, 64, bias=False)
            self.head.weight = self.embed.weight         # tied, as in SmolLM2

        def forward(self, ids):
            h = self.embed(ids)
            h = h + self.mlp(h)
            return self.head(h), self.odd(h)

    torch.manual_seed(0)
    model = Tiny().bfloat16()
    ids = torch.randint(0, 64, (11,))
    with torch.no_grad():
        want_head, want_odd = model(ids)
        assert pack_linear_layers(model) == 3
        got_head, got_odd = model(ids)
    assert isinstance(model.mlp.gate_up_proj, PackedLinear) and model.mlp.gate_up_proj.silu_mul
    assert model.mlp.gate_up_applies_act and type(model.odd) is nn.Linear
    assert isinstance(model.embed.weight, nn.Parameter)  # the embedding keeps the tied weight
    _close(got_odd, want_odd.double())
    _close(got_head, want_head.double())


# --- fused RMSNorm and rotary (sluice/attention/cpu/fused.cpp) ---------------------------------

def _ulps_close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0) -> None:
    """bf16 results within a couple of units in the last place of the reference (7 mantissa bits)."""
    got, want = got.float(), want.float()
    tol = ulps * want.abs().clamp_min(1e-3) * 2.0 ** -7
    bad = (got - want).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"


@pytest.mark.parametrize("h", [64, 100, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_matches_torch_path(h, with_residual):
    from sluice.model.layers import RMSNorm

    g = torch.Generator().manual_seed(h)
    norm = RMSNorm(h, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(h, generator=g) * 2)
    wide = torch.randn(37, h + 8, generator=g).bfloat16() * 3
    x = wide[:, 8:]                                   # strided rows, as a view of a projection
    res = torch.randn(37, h, generator=g).bfloat16() if with_residual else None
    want = norm(x, res)
    norm.fused = True
    got = norm(x, res)
    if with_residual:
        assert torch.equal(got[1], want[1])         # the new residual: one bf16 add, exact
        got, want = got[0], want[0]
    _ulps_close(got, want)


@pytest.mark.parametrize("rotary_dim", [None, 32])
def test_fused_rotary_matches_torch_path(rotary_dim):
    from sluice.model.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(64, 4096, 10000.0, rotary_dim=rotary_dim)
    t, hq, hk = 29, 9, 3
    qkv = torch.randn(t, (hq + 2 * hk) * 64, generator=g).bfloat16()
    q, k, _ = qkv.split([hq * 64, hk * 64, hk * 64], dim=-1)
    q, k = q.view(t, hq, 64), k.view(t, hk, 64)      # strided views, as in LlamaAttention
    positions = torch.randint(0, 4096, (t,), generator=g)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    rope.fused = True
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()          # rotated in place
    _ulps_close(got_q, want_q)
    _ulps_close(got_k, want_k)
    with pytest.raises(RuntimeError):
        rope(torch.tensor([5000] * t), q, k)         # past the table: refused, not read out of bounds


MODEL = Path.home() / ".cache" / "sluice" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not MODEL.exists(), reason="default model not downloaded")
def test_real_model_on_the_kernels_matches_the_torch_path():
    """SmolLM2 in bf16, one 96-token prefill: the model on the compiled kernels
    (packed linears, fused norm and rotary, cpu attention) against the same bf16 weights on plain
    torch ops. Both round to bf16 at every layer boundary, in different orders, so the logits
    differ by bf16 noise: the next-token choice agrees at (nearly) every position and the
    log-probabilities stay within a small distance."""
    from sluice.attention import create_backend
    from sluice.model.loader import load_model, load_model_config
    from test_attention_backend import SeqCase, build_metadata

    cfg = load_model_config(MODEL)
    models = {name: load_model(MODEL, cfg, torch.bfloat16, create_backend(name)) for name in ("torch", "cpu")}
    assert isinstance(models["cpu"].layers[0].mlp.gate_up_proj, PackedLinear)
    assert type(models["torch"].layers[0].mlp.gate_up_proj) is nn.Linear
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (96,), generator=g)
    logits = {}
    for name, model in models.items():
        caches = [(torch.zeros(16, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16),
                   torch.zeros(16, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16))
                  for _ in range(cfg.num_hidden_layers)]
        meta, _ = build_metadata([SeqCase(0, 96)], 16, 16, torch.Generator().manual_seed(1))
        with torch.inference_mode():
            hidden = model(ids, torch.arange(96), caches, meta)
            logits[name] = model.compute_logits(hidden).float().log_softmax(-1)
    a, b = logits["torch"], logits["cpu"]
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"next-token choice agrees at only {agree:.0%} of positions"
    # Log-probability of the reference's choice under both: bf16 noise is ~0.05-0.2 nats.
    top = a.argmax(-1, keepdim=True)
    gap = (a.gather(-1, top) - b.gather(-1, top)).abs()
    assert gap.median().item() < 0.1 and gap.max().item() < 1.0, (gap.median().item(), gap.max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_matches_torch_argmax(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 49152 + 7, generator=g).to(dtype)
    x[1, 100] = x[1, 40000] = 50.0                     # a tie: the first index wins
    x[2] = float("-inf")                                # all -inf: index 0
    x[3, 17] = float("nan")                             # NaN wins, as in torch
    x[4, -1] = 60.0                                     # the maximum in the tail past the last vector
    x[5, :16] = 70.0                                    # equal maxima across all lanes of the first vector
    x[6] = 1.0                                          # all equal: index 0
    wide = torch.randn(9, 60000, generator=g).to(dtype)
    wide[:, :x.shape[1]] = x
    for t in (x, wide[:, :x.shape[1]]):                 # contiguous, and rows further apart
        assert torch.equal(torch.ops.sluice.argmax_rows(t), t.argmax(dim=-1))
    assert torch.ops.sluice.argmax_rows(x[:0]).shape == (0,)


@pytest.mark.parametrize("silu_mul,n", [(False, 192), (False, 240), (True, 192), (True, 224)])
def test_a_row_does_not_depend_on_the_rows_beside_it(silu_mul, n, linear_path):
    """Each output row is the same bits whatever the row count: small batches and large ones take
    different code paths (on AVX2, one or two rows stream 4 column vectors at a time, weights
    widened once per block from 8 rows), and speculative verification (7 rows a request) must
    reproduce plain decoding (1 row) exactly. Widths 240 and 224 end in a narrower group. From
    192 rows the AVX-512 kernel deals row blocks x groups to the threads (300 rows: three full
    blocks and a partial one). On AMX every row count runs on the tiles, a partial last tile of
    16 rows from a zero-padded copy."""
    g = torch.Generator().manual_seed(7)
    k = 576
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    layer = PackedLinear(w, b, silu_mul=silu_mul)
    x = torch.randn(300, k, generator=g).bfloat16()
    whole = layer(x)
    # A different summation order moves only a few outputs in 10^4 across a bf16 rounding
    # boundary, so every row is compared, in chunks of each size.
    for m in (1, 2, 5, 7, 8, 9, 13, 97, 130, 200):
        part = torch.cat([layer(x[i:i + m]) for i in range(0, 300, m)])
        assert torch.equal(part, whole), f"rows differ between batches of {m} and one of 300"


# --- AMX (linear.cpp on CPUs with AMX tiles) ---------------------------------------------------

def test_amx_is_on_exactly_where_the_cpu_has_it():
    """The linears use AMX by default where the CPU has AMX-BF16 and the AVX-512 set is built (the
    kernel asks Linux for the tile state); it can be switched off and on; elsewhere it stays off."""
    was = torch.ops.sluice.linear_amx_enabled()
    try:
        assert was == _amx_here() or os.environ.get("SLUICE_CPU_AMX") == "0"
        assert torch.ops.sluice.linear_set_amx(False) is False
        assert torch.ops.sluice.linear_amx_enabled() is False
        assert torch.ops.sluice.linear_set_amx(True) is _amx_here()
        assert torch.ops.sluice.linear_amx_enabled() is _amx_here()
        assert extension.linear_isa() == ("amx_bf16" if _amx_here() else extension.kernel_isa())
    finally:
        torch.ops.sluice.linear_set_amx(was)


@pytest.mark.skipif(not _amx_here(), reason="no AMX on this CPU")
def test_sluice_cpu_amx_0_keeps_a_process_off_amx():
    code = ("import torch; from sluice.attention.cpu import extension; extension.load_extension(); "
            "print(torch.ops.sluice.linear_amx_enabled(), extension.linear_isa())")
    for env, want in (("0", "False avx512_bf16"), ("1", "True amx_bf16")):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SLUICE_CPU_AMX": env},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == want.split()


@pytest.mark.skipif(not _amx_here(), reason="no AMX on this CPU")
@pytest.mark.parametrize("silu_mul", [False, True])
def test_amx_and_vector_paths_agree_to_rounding(silu_mul):
    """The two paths sum in different orders: on the model's shapes they may differ in the last
    bf16 place of a few outputs in 10^3, never by more (or, for an output that nearly cancels, by
    float32 noise of the sum: 2^-16 of the output's scale). Fused, gate and up are each rounded to
    bf16 before silu(gate) * up, so one last-place step in either moves the product by up to ~3."""
    g = torch.Generator().manual_seed(11)
    k, n = 576, 3072
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    layer = PackedLinear(w, None, silu_mul=silu_mul)
    x = torch.randn(70, k, generator=g).bfloat16()
    was = torch.ops.sluice.linear_amx_enabled()
    try:
        assert torch.ops.sluice.linear_set_amx(True)
        tiles = layer(x).float()
        assert not torch.ops.sluice.linear_set_amx(False)
        vector = layer(x).float()
    finally:
        torch.ops.sluice.linear_set_amx(was)
    differ = tiles != vector
    assert differ.float().mean().item() < 1e-2
    ulps = 4.0 if silu_mul else 1.01
    tol = torch.maximum(vector.abs() * 2.0 ** -7 * ulps, vector.abs().max() * 2.0 ** -16)
    assert ((tiles - vector).abs() <= tol)[differ].all()


@pytest.mark.parametrize("silu_mul,n", [(False, 576), (False, 560), (False, 592), (False, 960), (True, 224), (True, 320),
                                        (True, 3072)])
def test_decode_sized_calls_give_the_same_bits_on_one_thread_and_two(silu_mul, n, linear_path):
    """Below the dealt sizes both paths split the half-group passes of all groups between the
    threads (576 columns are 9 groups: by groups the split was 5 / 4), so a group's two passes
    may run on different threads, and the vector path then runs that group pass by pass instead
    of in one sweep. Either way each output is the same sums in the same order: one thread and
    two give the same bits, with a narrower last group too (560: 48 columns, 592: 16), and a fused
    gate/up group cut in two (320: 5 groups)."""
    g = torch.Generator().manual_seed(n)
    k = 576
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    layer = PackedLinear(w, b, silu_mul=silu_mul)
    threads = torch.get_num_threads()
    try:
        for m in (1, 7, 33, 130):
            x = torch.randn(m, k, generator=g).bfloat16()
            torch.set_num_threads(2)
            two = layer(x)
            torch.set_num_threads(1)
            one = layer(x)
            assert torch.equal(one, two), f"{m} rows differ between one thread and two"
            want = _ref(x, w, b)
            _close(two, silu_and_mul(want.bfloat16().double()) if silu_mul else want)
    finally:
        torch.set_num_threads(threads)
