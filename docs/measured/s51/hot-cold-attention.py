# One layer call's wall time with its K/V resident (hot: one layer repeated) and cold (layers past
# 128 MiB, as benchmarks/attention.py). Run from the repo root with PYTHONPATH at the checkout.
import sys, time, torch
sys.path.insert(0, '/work/main/benchmarks')
import attention as A
from sluice.attention import create_backend
torch.set_num_threads(2)
be = create_backend("cpu")
g = torch.Generator().manual_seed(0)
clock = time.perf_counter
# cases as b,q,c arguments (python3 hot-cold-attention.py 16,9,1536 16,1,1536 8,7,2048), else b = 4
cases = [tuple(map(int, a.split(','))) for a in sys.argv[1:]] or [(4,9,1024),(4,1,1024),(4,4,1024),(4,9,2048)]
for b,q,c in cases:
    case = A.Case(f"v b={b} q={q} c={c}", [c-q]*b, [q]*b)
    hot = [A.make_layer(case, torch.bfloat16, g, True)]
    kvb = A.kv_bytes(case, torch.bfloat16)
    n = max(1, (128<<20)//kvb)
    cold = [A.make_layer(case, torch.bfloat16, g, True) for _ in range(n)]
    th = A.time_layer(be, hot, 200, clock); tc = A.time_layer(be, cold, 5, clock)
    print(f"{case.label}: KV {kvb/1e6:.2f} MB hot {th*1e6:.1f} us cold {tc*1e6:.1f} us  cold/hot {tc/th:.2f}  cold GB/s {kvb/tc/1e9:.1f}")
