"""Decode step time vs batch size and context length, and prefill tokens/s, through the real
engine (scheduler + runner + sampler), printed beside a roofline estimate.

    .venv/bin/python benchmarks/step_time.py [--batches 1 8 32] [--contexts 256 1024 2048]
"""
from __future__ import annotations

import argparse
import time

import torch

from sluice import LLM, SamplingParams
from sluice.config import WEIGHT_FORMATS


def matmul_flops_per_token(cfg) -> float:
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return 2.0 * (L * per_layer + h * cfg.vocab_size)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scatter", action="store_true",
                    help="shuffle the free block queue first, so that a sequence's blocks lie scattered "
                         "over the cache as in a server that has run for a while")
    ap.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                    help="a GGUF's Q4_1 / Q8_0 linears kept in their blocks (native) or dequantized to bf16 at load "
                         "(auto: native where the linears run on AMX)")
    ap.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="weights and KV cache on ordinary pages (sluice/hugepages.py)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=4096, kv_cache_tokens=32 * 2304 + 4096,
              max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
              attention_backend=args.backend, block_size=args.block_size, huge_pages=args.huge_pages,
              weight_format=args.weight_format)
    eng = llm.engine
    if args.scatter:
        import random

        pool = eng.scheduler.kv.pool
        ids = list(pool._free)
        random.Random(0).shuffle(ids)
        pool._free = type(pool._free)((i, pool._free[i]) for i in ids)
    cfg = eng.config.model
    flops = matmul_flops_per_token(cfg)
    print(f"threads={torch.get_num_threads()} backend={args.backend} block_size={args.block_size} "
          f"scatter={args.scatter} huge_pages={args.huge_pages} matmul GFLOP/token={flops / 1e9:.3f}")
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'tok/s':>8} {'GFLOP/s(matmul)':>15}")
    for ctx in args.contexts:
        for b in args.batches:
            g = torch.Generator().manual_seed(b * 7919 + ctx)
            # Early requests decode while later ones prefill: leave room for those tokens, so that
            # all b requests are still decoding in the timed steps (checked below). The prefill
            # takes up to one step per token budget, and up to one per prompt (a step that
            # completes a prompt closes to further prompt chunks: SchedulerConfig.close_step_tokens).
            budget = eng.config.scheduler.max_num_batched_tokens
            max_tokens = args.steps + 3 + -(-b * ctx // budget) + b + 2
            for i in range(b):
                prompt = torch.randint(100, 40000, (ctx,), generator=g).tolist()
                eng.add_request(f"b{b}c{ctx}r{i}", prompt,
                                SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            # Prefill everything, then time pure decode steps.
            t0 = time.perf_counter()
            while any(r.num_output_tokens == 0 for r in eng.scheduler.running + eng.scheduler.waiting):
                eng.step()
            prefill_s = time.perf_counter() - t0
            eng.step()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            dt = (time.perf_counter() - t0) / args.steps
            decoding = sum(1 for r in eng.scheduler.running if r.num_output_tokens > 0)
            assert decoding == b, f"only {decoding} of {b} requests were decoding in the timed steps"
            for r in list(eng.scheduler.running + eng.scheduler.waiting):
                eng.abort_request(r.request_id)
            eng.step()
            print(f"{b:>5} {ctx:>7} {dt * 1e3:>8.1f} {b / dt:>8.1f} {b * flops / dt / 1e9:>15.1f}"
                  f"   (prefill {b * ctx / prefill_s:.0f} tok/s)")


if __name__ == "__main__":
    main()
