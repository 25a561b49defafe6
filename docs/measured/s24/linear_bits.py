import sys, torch
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
g = torch.Generator().manual_seed(3)
outs = []
for n, k, silu in [(960, 576, False), (576, 1536, False), (3072, 576, True), (49152, 576, False), (96, 64, True)]:
    p = pack_weight(torch.randn(n, k, generator=g).to(torch.bfloat16) * .02)
    for m in (1, 7, 8, 32, 95, 96, 97, 200, 336):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        op = torch.ops.sluice.linear_bf16_silu_mul if silu else torch.ops.sluice.linear_bf16
        outs.append(op(x, p, n, None))
torch.save(outs, sys.argv[1])
