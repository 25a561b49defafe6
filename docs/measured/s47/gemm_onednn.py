"""30 layers' projections of SmolLM2 through torch.nn.functional.linear (oneDNN) at given row
counts, 2 threads: the comparison for gemm_rows.py (sluice's packed AMX linears)."""
import sys
import time

import torch

torch.set_num_threads(2)
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
torch.manual_seed(0)
layers = [[(torch.randn(n, k) / k ** 0.5).bfloat16() for k, n in shapes] for _ in range(30)]


def step(x576, x1536):
    for l in layers:
        torch.nn.functional.linear(x576, l[0]); torch.nn.functional.linear(x576, l[1])
        torch.nn.functional.linear(x576, l[2]); torch.nn.functional.linear(x1536, l[3])


def best(fn, rep=25):
    fn(); ts = []
    for _ in range(rep):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[0], ts[len(ts) // 2]


wbytes = 2 * 30 * sum(k * n for k, n in shapes)
for m in [int(a) for a in sys.argv[1:]] or [1, 8, 32]:
    x576 = torch.randn(m, 576).bfloat16(); x1536 = torch.randn(m, 1536).bfloat16()
    b, med = best(lambda: step(x576, x1536))
    print(f"rows {m:4d}: best {b*1e3:6.2f} ms ({wbytes/b/1e9:5.1f} GB/s), median {med*1e3:6.2f} ms")
