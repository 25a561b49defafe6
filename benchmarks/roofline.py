"""The roofline for SmolLM2-135M on this machine, derived from measured kernels.

Measures (a) bf16 GEMM throughput for the model's own weight shapes at 1..512 rows, (b) memory
read bandwidth; then derives:
- the ideal decode step at batch B and context C: GEMMs at the measured rate for B rows, plus
  attention reading each sequence's K/V once at the measured read bandwidth;
- the ideal prefill cost per token (GEMMs at the measured rate for a 512-row step);
- the ceiling of aggregate output tok/s for an agent workload at concurrency N: per call,
  P prefill tokens and D decoded tokens, all decodes batched N wide.

    .venv/bin/python benchmarks/roofline.py [--batch 32] [--context 1500] [--prefill 300] [--decode 100]
"""
from __future__ import annotations

import argparse
import time

import torch

# SmolLM2-135M: (K, N) of each GEMM per layer, plus the LM head.
HIDDEN, INTER, LAYERS, VOCAB, KV_HEADS, HEAD_DIM = 576, 1536, 30, 49152, 3, 64
LAYER_SHAPES = [(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]


def bench(fn, repeats: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def gemm_time(rows: int) -> float:
    """Seconds for all GEMMs of one forward over `rows` tokens (bf16, weights [N, K])."""
    total = 0.0
    for k, n in LAYER_SHAPES:
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        total += LAYERS * bench(lambda: torch.nn.functional.linear(x, w))
    x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
    w = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    # The LM head runs only on sampled rows: one per sequence (decode) or per chunk (prefill).
    return total, bench(lambda: torch.nn.functional.linear(x, w), 5)


def flops(rows: int) -> float:
    per_layer = sum(2 * k * n for k, n in LAYER_SHAPES)
    return rows * LAYERS * per_layer


def read_bandwidth() -> float:
    """Bytes/s streamed by a float32 dot product of two 256 MiB vectors (a pure read, as
    attention reads K/V; the arithmetic is far below the FMA peak)."""
    a = torch.ones(64 << 20, dtype=torch.float32)
    b = torch.ones(64 << 20, dtype=torch.float32)
    t = bench(lambda: torch.dot(a, b), 5)
    return 2 * 4 * a.numel() / t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--prefill", type=int, default=300, help="new prompt tokens per call")
    ap.add_argument("--decode", type=int, default=100, help="output tokens per call")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    bw = read_bandwidth()
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s")
    print(f"{'rows':>5} {'GEMM ms':>8} {'GFLOP/s':>8} {'LM head ms (rows)':>18}")
    rates = {}
    for rows in (1, 8, 32, 64, 128, 256, 512):
        t, head = gemm_time(rows)
        rates[rows] = flops(rows) / t
        print(f"{rows:>5} {t * 1e3:>8.2f} {rates[rows] / 1e9:>8.1f} {head * 1e3:>18.2f}")

    b, c = args.batch, args.context
    t_gemm, t_head = gemm_time(b)
    kv_bytes = b * c * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    t_attn = kv_bytes / bw
    step = t_gemm + t_head + t_attn
    print(f"\nideal decode step, batch {b}, context {c}: {step * 1e3:.1f} ms "
          f"(GEMM {t_gemm * 1e3:.1f} + LM head {t_head * 1e3:.1f} + K/V read {t_attn * 1e3:.1f}) "
          f"-> {b / step:.0f} tok/s, {1 / step:.1f} tok/s per sequence")

    t512, _ = gemm_time(512)
    per_prefill_token = t512 / 512
    per_call = args.prefill * per_prefill_token + args.decode * step / b
    print(f"ideal prefill: {per_prefill_token * 1e3:.3f} ms/token ({1 / per_prefill_token:.0f} tok/s)")
    print(f"agent-call ceiling ({args.prefill} prefill + {args.decode} decoded tokens per call, decodes "
          f"{b} wide): {args.decode / per_call:.0f} aggregate output tok/s")


if __name__ == "__main__":
    main()
