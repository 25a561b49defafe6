"""Decode steps of two engines in one process, one with weights and KV cache on transparent huge
pages and one without, alternating in ABBA rounds, so that the host's drift (this machine's
neighbours move identical runs by +-20%) hits both alike.

    .venv/bin/python docs/measured/s31/huge_pages_ab.py [--batch 32] [--context 1024] [--rounds 12]
"""
import argparse
import random
import statistics
import time

import torch

from sluice import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=32)
ap.add_argument("--context", type=int, default=1024)
ap.add_argument("--rounds", type=int, default=12)
ap.add_argument("--steps", type=int, default=8)
args = ap.parse_args()

engines = {}
for huge in (True, False):
    llm = LLM(None, max_model_len=4096, kv_cache_tokens=args.batch * (args.context + 16 * args.rounds * args.steps) + 4096,
              max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False, huge_pages=huge)
    eng = llm.engine
    pool = eng.scheduler.kv.pool  # scattered blocks, as in a server that has run for a while
    ids = list(pool._free)
    random.Random(0).shuffle(ids)
    pool._free = type(pool._free)((i, pool._free[i]) for i in ids)
    g = torch.Generator().manual_seed(1)
    for i in range(args.batch):
        prompt = torch.randint(100, 40000, (args.context,), generator=g).tolist()
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4 * args.rounds * args.steps,
                                                        ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in eng.scheduler.running + eng.scheduler.waiting):
        eng.step()
    engines["huge" if huge else "4k"] = eng

times = {k: [] for k in engines}
for r in range(args.rounds):
    order = list(engines) if r % 2 == 0 else list(engines)[::-1]
    for name in order:
        eng = engines[name]
        eng.step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
        assert sum(1 for q in eng.scheduler.running if q.num_output_tokens > 0) == args.batch
    print(f"round {r}: " + "  ".join(f"{k} {times[k][-1]:.1f} ms" for k in engines), flush=True)
ratios = [a / b for a, b in zip(times["huge"], times["4k"])]
print(f"batch {args.batch}, context {args.context}: step ms median huge {statistics.median(times['huge']):.1f}, "
      f"4k {statistics.median(times['4k']):.1f}; huge/4k per round median {statistics.median(ratios):.3f} "
      f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {sum(x < 1 for x in ratios)}/{len(ratios)} rounds faster)")
