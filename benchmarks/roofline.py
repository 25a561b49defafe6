"""The roofline for SmolLM2-135M on this machine, derived from measured kernels.

Measures, on this machine's threads:
- the FMA peak: benchmarks/fma_peak.c (12 independent vector FMA chains per thread, no memory
  traffic), built with gcc -march=native; the hardware roofline counts every GEMM FLOP at it;
- bf16 GEMM time over the model's own weight shapes at 1..512 rows, for oneDNN (torch) and for
  sluice's packed kernel (when it builds here); the roofline takes the faster of the two;
- memory read bandwidth (a multi-threaded sum over 1 GiB: attention reads K/V this way);
- paged attention of a prefill chunk over a long prefix (the compiled kernel's FLOP rate; the
  torch reference's when the kernel is unavailable);
and derives:
- the hardware decode step at batch B and context C: every GEMM FLOP (LM head included) at the FMA
  peak + each sequence's K/V read once at the measured bandwidth (the bound no kernel can beat);
- the ideal decode step at batch B and context C: GEMMs for B rows + LM head + reading each
  sequence's K/V once at the measured bandwidth;
- the ideal prefill cost per token: GEMMs at the 512-row rate plus the attention FLOPs of a chunk
  over its prefix (4 * context * heads * head_dim per token and layer) at the measured rate;
- the ceiling of aggregate output tok/s for an agent workload at concurrency N: per call,
  P prefill tokens (attending to about --prefill-context tokens) and D decoded tokens, all decodes
  batched N wide. The engine is assumed busy all the time, so this is an upper bound.

    .venv/bin/python benchmarks/roofline.py [--batch 32] [--context 1300] [--prefill 336]
                                            [--prefill-context 1300] [--decode 100]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

# SmolLM2-135M: (K, N) of each GEMM per layer, plus the LM head.
HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 30, 49152, 9, 3, 64
LAYER_SHAPES = [(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]


def bench(fn, repeats: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def packed_kernel():
    """sluice's packed linear op, or None where the extension does not build."""
    try:
        from sluice.attention.cpu.extension import load_extension
        from sluice.model.packed_linear import pack_weight

        load_extension()
        return lambda w: (lambda x, p=pack_weight(w), n=w.shape[0]: torch.ops.sluice.linear_bf16(x, p, n, None))
    except Exception:  # noqa: BLE001 - the roofline still stands on oneDNN alone
        return None


def gemm_time(rows: int, kernel) -> tuple[float, float, float]:
    """Seconds for all GEMMs of one forward over `rows` tokens: (oneDNN, packed or inf, LM head best).

    Every layer's weights are distinct tensors, as in the model, so a forward streams them all
    from memory instead of re-reading one layer's from cache."""
    x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    ws = [[torch.randn(n, k, dtype=torch.bfloat16) for (k, n) in LAYER_SHAPES] for _ in range(LAYERS)]
    onednn = bench(lambda: [torch.nn.functional.linear(x[w.shape[1]], w) for layer in ws for w in layer], 5)
    packed = float("inf")
    if kernel is not None:
        fns = [kernel(w) for layer in ws for w in layer]
        packed = bench(lambda: [f(x[HIDDEN] if i % 4 != 3 else x[INTER]) for i, f in enumerate(fns)], 5)
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    t_head = bench(lambda: torch.nn.functional.linear(x[HIDDEN], head), 5)
    if kernel is not None:
        f = kernel(head)
        t_head = min(t_head, bench(lambda: f(x[HIDDEN]), 5))
    return onednn, packed, t_head


def flops(rows: int) -> float:
    return rows * LAYERS * sum(2 * k * n for k, n in LAYER_SHAPES)


def read_bandwidth() -> float:
    """Bytes/s of a multi-threaded float32 sum over 1 GiB (a pure read, far below the FMA peak)."""
    a = torch.ones(256 << 20, dtype=torch.float32)
    return 4 * a.numel() / bench(lambda: a.sum(), 5)


def fma_peak(threads: int) -> dict[str, float]:
    """FLOP/s of this CPU's FMA units on `threads` threads, from benchmarks/fma_peak.c: {"fp32": ...}
    with the widest float vectors the compiler targets here, plus "bf16dot" where the CPU has
    AVX-512 BF16. Empty where gcc or the build is missing."""
    src = Path(__file__).with_name("fma_peak.c")
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "fma_peak")
        try:
            subprocess.run(["gcc", "-O2", "-march=native", "-fopenmp", str(src), "-o", exe], check=True,
                           capture_output=True)
            out = subprocess.run([exe], check=True, capture_output=True, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
        except (OSError, subprocess.CalledProcessError):
            return {}
    return {kind: float(v) * 1e9 for kind, v in (line.split() for line in out.splitlines() if line.strip())}


def prefill_attention_rate(chunk: int, context: int) -> tuple[float, str]:
    """FLOP/s of paged attention for one `chunk`-token prefill over `context` cached tokens."""
    from sluice.attention import create_backend
    from sluice.attention.base import AttentionMetadata

    backend = create_backend("auto")
    block = 16
    total = context + chunk
    nblocks = -(-total // block)
    kc = torch.randn(nblocks, block, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(chunk, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    k = torch.randn(chunk, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    pos = torch.arange(context, total)
    meta = AttentionMetadata(
        slot_mapping=pos.to(torch.int64), query_start_loc=torch.tensor([0, chunk], dtype=torch.int32),
        seq_lens=torch.tensor([total], dtype=torch.int32),
        block_tables=torch.arange(nblocks, dtype=torch.int32).view(1, -1), num_decodes=0,
        max_query_len=chunk, max_seq_len=total, query_lens_list=[chunk], seq_lens_list=[total])
    t = bench(lambda: backend.forward(q, k, v, kc, vc, meta, HEAD_DIM ** -0.5), 5)
    fl = 4 * HEADS * HEAD_DIM * chunk * (context + (chunk + 1) / 2)
    return fl / t, backend.name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1300, help="context of each decoding sequence")
    ap.add_argument("--prefill", type=int, default=336, help="new prompt tokens per call")
    ap.add_argument("--prefill-context", type=int, default=1300, help="cached prefix a call's prefill attends to")
    ap.add_argument("--decode", type=int, default=100, help="output tokens per call")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bw = read_bandwidth()
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s")
    peaks = fma_peak(torch.get_num_threads())
    print("FMA peak: " + (", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items()) or "not measured (no gcc)"))
    kernel = packed_kernel()
    print(f"{'rows':>5} {'oneDNN ms':>9} {'GFLOP/s':>8} {'packed ms':>9} {'GFLOP/s':>8} {'LM head ms':>10}")
    best = {}
    for rows in (1, 8, 16, 32, 64, 128, 512):
        a, b, head = gemm_time(rows, kernel)
        best[rows] = (min(a, b), head)
        print(f"{rows:>5} {a * 1e3:>9.2f} {flops(rows) / a / 1e9:>8.1f} {b * 1e3:>9.2f} "
              f"{flops(rows) / b / 1e9:>8.1f} {head * 1e3:>10.2f}")

    b, c = args.batch, args.context
    if b not in best:
        a, p, head = gemm_time(b, kernel)
        best[b] = (min(a, p), head)
    t_gemm, t_head = best[b]
    kv_bytes = b * c * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    t_kv = kv_bytes / bw
    print()
    if peaks:
        # The fastest way this CPU has to do the GEMMs' FLOPs: bf16 dot products where it has them.
        peak = max(peaks.values())
        t_fl = (flops(b) + 2 * b * HIDDEN * VOCAB) / peak
        print(f"hardware decode step, batch {b}, context {c}: {(t_fl + t_kv) * 1e3:.1f} ms "
              f"(GEMM + LM head {t_fl * 1e3:.1f} at {peak / 1e9:.0f} GFLOP/s + K/V read {t_kv * 1e3:.1f})")
    step = t_gemm + t_head + t_kv
    print(f"ideal decode step (GEMMs at the best measured kernel rate), batch {b}, "
          f"context {c}: {step * 1e3:.1f} ms "
          f"(GEMM {t_gemm * 1e3:.1f} + LM head {t_head * 1e3:.1f} + K/V read {t_kv * 1e3:.1f}) "
          f"-> {b / step:.0f} tok/s, {1 / step:.1f} tok/s per sequence")

    rate, name = prefill_attention_rate(min(args.prefill, 512), args.prefill_context)
    t512 = best[512][0]
    gemm_per_token = t512 / 512
    attn_per_token = 4 * HEADS * HEAD_DIM * LAYERS * (args.prefill_context + args.prefill / 2) / rate
    per_prefill_token = gemm_per_token + attn_per_token
    print(f"prefill attention ({name} backend, {args.prefill} tokens over {args.prefill_context}): "
          f"{rate / 1e9:.0f} GFLOP/s")
    print(f"ideal prefill: {per_prefill_token * 1e3:.3f} ms/token (GEMM {gemm_per_token * 1e3:.3f} + "
          f"attention {attn_per_token * 1e3:.3f}; {1 / per_prefill_token:.0f} tok/s)")
    per_call = args.prefill * per_prefill_token + args.decode * step / b
    print(f"agent-call ceiling ({args.prefill} prefill + {args.decode} decoded tokens per call, decodes "
          f"{b} wide): {args.decode / per_call:.0f} aggregate output tok/s "
          f"(prefill {args.prefill * per_prefill_token * 1e3:.0f} ms + decode {args.decode * step / b * 1e3:.0f} ms "
          f"of engine time per call)")


if __name__ == "__main__":
    main()
