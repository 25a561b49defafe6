import sys, time, statistics, torch
sys.argv=sys.argv
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
torch.set_num_threads(2)
HIDDEN, INTER, LAYERS = 576, 1536, 30
SHAPES=[(HIDDEN, 960),(HIDDEN, HIDDEN),(HIDDEN, 2*INTER),(INTER, HIDDEN)]  # qkv, o, gate_up, down
ws=[[(pack_weight(torch.randn(n,k,dtype=torch.bfloat16)), n, k) for (k,n) in SHAPES] for _ in range(LAYERS)]
def run(m):
    x={k: torch.randn(m,k,dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    def f():
        for layer in ws:
            for i,(p,n,k) in enumerate(layer):
                if i==2: torch.ops.sluice.linear_bf16_silu_mul(x[k], p, n, None)
                else: torch.ops.sluice.linear_bf16(x[k], p, n, None)
    f()
    ts=[]
    for _ in range(int(sys.argv[1]) if len(sys.argv)>1 else 15):
        t=time.perf_counter(); f(); ts.append((time.perf_counter()-t)*1e3)
    return statistics.median(ts), min(ts)
for m in (4, 8, 16, 24, 32, 48):
    med, best = run(m)
    print(f"m={m:3d} median {med:6.2f} ms best {best:6.2f} ms")
