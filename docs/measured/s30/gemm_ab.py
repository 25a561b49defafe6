import time, torch, sys
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension(); torch.set_num_threads(int(__import__("os").environ.get("T","2")))
torch.manual_seed(0)
shapes=[(576,960),(576,576),(576,3072),(1536,576)]
ws=[(pack_weight(torch.randn(n,k).to(torch.bfloat16)), n) for k,n in shapes]
def step(x_by_k):
    for (p,n),(k,_) in zip(ws,shapes):
        torch.ops.sluice.linear_bf16(x_by_k[k], p, n, None)
res=[]
for m in [int(a) for a in sys.argv[1:]]:
    xs={k: torch.randn(m,k).to(torch.bfloat16) for k,_ in shapes}
    for _ in range(3): step(xs)
    best=1e9
    for _ in range(30):
        t=time.perf_counter()
        for _ in range(30): step(xs)   # 30 layers
        best=min(best,time.perf_counter()-t)
    flops=2*m*sum(k*n for k,n in shapes)*30
    res.append(f"m={m}: {best*1e3:.2f} ms {flops/best/1e9:.0f} GFLOP/s")
print(" | ".join(res))
