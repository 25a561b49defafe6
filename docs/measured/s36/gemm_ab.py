import time, torch, sys
sys.path.insert(0,'/work/main/benchmarks')
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
from roofline import LAYER_SHAPES, bench, flops, HIDDEN, INTER
torch.manual_seed(0)
ws = [[torch.randn(n, k, dtype=torch.bfloat16) for (k, n) in LAYER_SHAPES] for _ in range(30)]
ps=[[(pack_weight(w),w.shape[0]) for w in layer] for layer in ws]
res=[]
for rows in (96,160,200,336,512):
    x = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}
    def run():
        for layer in ps:
            for i,(p,n) in enumerate(layer):
                if i==2: torch.ops.sluice.linear_bf16_silu_mul(x[HIDDEN], p, n, None)
                else: torch.ops.sluice.linear_bf16(x[HIDDEN] if i!=3 else x[INTER], p, n, None)
    t=bench(run,5); res.append(f"{rows}:{flops(rows)/t/1e9:.0f}")
print(sys.argv[1], " ".join(res), "GF/s")
