# save or compare packed-linear outputs: linbits.py save|cmp FILE
import sys, torch
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
g = torch.Generator().manual_seed(1)
outs = []
for n, k in [(960, 576), (576, 576), (576, 1536), (3072, 576), (64, 600), (48, 40)]:
    w = (torch.randn(n, k, generator=g) * .05).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    p = pack_weight(w)
    for m in [1, 2, 3, 5, 7, 8, 13, 30, 32, 33, 95, 96, 97, 200, 336]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        outs.append(torch.ops.sluice.linear_bf16(x, p, n, None))
        outs.append(torch.ops.sluice.linear_bf16(x, p, n, b))
        if n % 64 == 0:
            outs.append(torch.ops.sluice.linear_bf16_silu_mul(x, p, n, None))
if sys.argv[1] == "save":
    torch.save(outs, sys.argv[2])
else:
    ref = torch.load(sys.argv[2])
    bad = sum(not torch.equal(a.view(torch.int16), r.view(torch.int16)) for a, r in zip(outs, ref))
    print(f"{len(outs)} outputs, {bad} differ in bits")
