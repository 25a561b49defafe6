import torch, time, sys
import os; torch.set_num_threads(int(os.environ.get("NT","2")))
from sluice.attention.cpu import extension
extension.load_extension()
from sluice.model.packed_linear import PackedLinear
shapes = {"qkv":(960,576),"o":(576,576),"gate_up":(3072,576),"down":(576,1536),"lm_head":(49152,576)}
for M in [1,8,32,224]:
    tot=0; line=[]
    for name,(n,k) in shapes.items():
        w=torch.randn(n,k).bfloat16()*0.02
        lin=PackedLinear(w,None,silu_mul=(name=="gate_up"))
        x=torch.randn(M,k).bfloat16()
        for _ in range(3): lin(x)
        reps = 20 if name!="lm_head" else 5
        t=time.perf_counter()
        for _ in range(reps): lin(x)
        dt=(time.perf_counter()-t)/reps
        mult = 1 if name=="lm_head" else 30
        tot += dt*mult
        line.append(f"{name} {dt*1e3:.3f}ms {2*M*n*k/dt/1e9:.0f}GF/s {n*k*2/dt/1e9:.1f}GB/s")
    print(f"M={M} total(30 layers+head)={tot*1e3:.1f} ms | " + " | ".join(line))
