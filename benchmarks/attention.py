"""Per-layer paged-attention time, torch reference vs the compiled cpu backend, beside a
memory-bandwidth roofline, on SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64).

    .venv/bin/python benchmarks/attention.py [--dtype bfloat16|float32] [--repeats 20]
                                             [--only LABEL-SUBSTRING] [--no-torch]

Cases: decodes at batch 1/8/32 with context 256/1024/2048, speculative verifications (4 and 7 query
tokens per sequence) at batch 8/32 and context 1024/2048, one 512-token prefill chunk after a
1024-token prefix and two 256-token chunks after 2048. Each layer call writes the step's K/V and attends; the caches rotate over
enough layers (at least 128 MiB of KV in all) that K/V come from memory, not the last-level
cache, as they do in a 30-layer model. Times are the best call over all layers and repeats (the
machine is shared).

Roofline: the K/V bytes a call must read (every context token's K and V row once) divided by the
copy bandwidth measured here with a large tensor copy, counting bytes read plus bytes written.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from sluice import hugepages
from sluice.attention import AttentionMetadata, create_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
MIN_KV_BYTES = 128 << 20


@dataclass(frozen=True)
class Case:
    label: str
    context: list[int]    # tokens already cached, per sequence
    query: list[int]      # new tokens this step, per sequence (1: a decode)


def cases() -> list[Case]:
    out = [Case(f"decode b={b:<2} ctx={c}", [c - 1] * b, [1] * b) for c in (256, 1024, 2048) for b in (1, 8, 32)]
    # speculative verification: each sequence's last token plus 3 drafts, 6 (where the adaptive
    # draft length starts) or 8 (about its mean on agent traffic, sessions 46-47)
    out += [Case(f"verify b={b:<2} q={q} ctx={c}", [c - q] * b, [q] * b)
            for q in (4, 7, 9) for c in (1024, 2048) for b in (8, 32)]
    out.append(Case("prefill 512 after 1024", [1024], [512]))
    out.append(Case("prefill 2x256 after 2048", [2048, 2048], [256, 256]))
    return out


def copy_bandwidth(clock, repeats: int = 5) -> float:
    """Bytes read + written per second of a 512 MiB tensor copy (best of `repeats`)."""
    src = torch.ones(128 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        dst.copy_(src)
        best = min(best, clock() - t0)
    return 2 * src.numel() * src.element_size() / best


def make_layer(case: Case, dtype: torch.dtype, g: torch.Generator, huge_pages: bool = False):
    """Metadata plus inputs of one layer call, with block tables drawn from a shuffled pool."""
    seq_lens = [c + q for c, q in zip(case.context, case.query)]
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    pool = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, used = [], 0
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = pool[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(case.context[i], seq_lens[i])
        slots.append(tables[i, pos // BLOCK_SIZE].to(torch.int64) * BLOCK_SIZE + pos % BLOCK_SIZE)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(case.query), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, num_decodes=sum(1 for q in case.query if q == 1) if max(case.query) == 1 else 0,
        max_query_len=max(case.query), max_seq_len=max(seq_lens), query_lens_list=list(case.query),
        seq_lens_list=seq_lens)
    t = sum(case.query)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(dtype)              # [T, H, D]
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)           # [T, KVH, D]
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = hugepages.zeros([(shape, dtype)] * 2, huge_pages)
    for c in caches:
        c.copy_(torch.randn(shape, generator=g))
    return meta, q, k, v, caches


def kv_bytes(case: Case, dtype: torch.dtype) -> int:
    tokens = sum(c + q for c, q in zip(case.context, case.query))
    return 2 * tokens * KV_HEADS * HEAD_DIM * torch.finfo(dtype).bits // 8


def attention_flops(case: Case) -> float:
    pairs = sum(q * c + q * (q + 1) / 2 for c, q in zip(case.context, case.query))  # (query, key) pairs
    return 4.0 * pairs * HEADS * HEAD_DIM


def time_layer(backend, layers, repeats: int, clock) -> float:
    """Best single layer call over `repeats` passes through all layers, as a model step makes
    them (the best call, not the best pass: a pass of many calls rarely escapes the noise)."""
    scale = HEAD_DIM ** -0.5
    best = float("inf")
    for _ in range(repeats):
        for meta, q, k, v, (kc, vc) in layers:
            t0 = clock()
            backend.forward(q, k, v, kc, vc, meta, scale)
            best = min(best, clock() - t0)
    return best


def main() -> None:
    global BLOCK_SIZE
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU clock")
    ap.add_argument("--only", default=None, help="run only the cases whose label contains this")
    ap.add_argument("--no-torch", action="store_true", help="skip the (slow) torch reference")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per KV cache block")
    ap.add_argument("--huge-pages", action="store_true", help="KV caches on transparent huge pages, as the engine's")
    args = ap.parse_args()
    BLOCK_SIZE = args.block_size
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    dtype = getattr(torch, args.dtype)
    backends = {name: create_backend(name) for name in (("cpu",) if args.no_torch else ("torch", "cpu"))}
    bw = copy_bandwidth(clock)
    print(f"threads={torch.get_num_threads()} dtype={args.dtype} block_size={BLOCK_SIZE} "
          f"huge_pages={args.huge_pages and hugepages.available()} clock={'thread CPU' if args.cpu_time else 'wall'} "
          f"copy bandwidth={bw / 1e9:.1f} GB/s (read+write); per-layer times, best of {args.repeats}")
    print(f"{'case':<24} {'KV MB':>6} {'roofline us':>11} {'torch us':>9} {'cpu us':>8} {'speedup':>7} "
          f"{'cpu GB/s':>8} {'cpu/roof':>8} {'cpu GFLOP/s':>11}")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for case in cases():
            if args.only and args.only not in case.label:
                continue
            nbytes = kv_bytes(case, dtype)
            num_layers = max(2, -(-MIN_KV_BYTES // nbytes))
            layers = [make_layer(case, dtype, g, args.huge_pages) for _ in range(num_layers)]
            times = {name: time_layer(b, layers, args.repeats, clock) for name, b in backends.items()}
            roof = nbytes / bw
            cpu = times["cpu"]
            times.setdefault("torch", float("nan"))
            print(f"{case.label:<24} {nbytes / 1e6:>6.2f} {roof * 1e6:>11.1f} {times['torch'] * 1e6:>9.1f} "
                  f"{cpu * 1e6:>8.1f} {times['torch'] / cpu:>6.1f}x {nbytes / cpu / 1e9:>8.1f} "
                  f"{cpu / roof:>8.2f} {attention_flops(case) / cpu / 1e9:>11.1f}")


if __name__ == "__main__":
    main()
