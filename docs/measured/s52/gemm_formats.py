"""Session 52 (AMD EPYC Zen 4, vector path): the 30 layers' projections of the real SmolLM2 weights,
`--weight-format native` (the GGUF's Q4_1 blocks, dequantized as the kernel computes) against bf16
(dequantized at load), at row counts from a decode to a prefill chunk; best and median of N calls,
the two formats alternating per row count.

    .venv/bin/python docs/measured/s52/gemm_formats.py [rows ...]
"""
import sys, time
import torch
torch.set_num_threads(2)
from sluice import LLM
from sluice.model.packed_linear import PackedLinear

def layers_of(fmt):
    llm = LLM(weight_format=fmt, kv_cache_tokens=8192)
    model = llm.engine.runner.model
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, PackedLinear) and "lm_head" not in name:
            out.append((name, mod))
    return llm, out

def best(fn, rep):
    fn(); ts = []
    for _ in range(rep):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[0], ts[len(ts) // 2]

keep = {}
for fmt in ("native", "bf16"):
    keep[fmt] = layers_of(fmt)
    print(fmt, len(keep[fmt][1]), "packed linears;", str(keep[fmt][1][0][1].packed.dtype))
rows = [int(a) for a in sys.argv[1:]] or [1, 8, 32, 96, 192, 256, 512]
for rnd in (1, 2):
    for m in rows:
        line = [f"round {rnd} rows {m:4d}:"]
        for fmt in (("native", "bf16") if rnd == 1 else ("bf16", "native")):
            mods = keep[fmt][1]
            xs = {}
            for _, mod in mods:
                k = mod.in_features
                if k not in xs: xs[k] = torch.randn(m, k).bfloat16()
            def step():
                for _, mod in mods: mod(xs[mod.in_features])
            b, med = best(step, 25 if m <= 64 else 8)
            line.append(f"{fmt} best {b*1e3:7.2f} ms median {med*1e3:7.2f}")
        print("  ".join(line), flush=True)
