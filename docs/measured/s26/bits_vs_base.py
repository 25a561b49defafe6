# Attention outputs of one tree saved for an exact comparison with another (same inputs, seeded):
#   echo /tmp/head.pt | PYTHONSAFEPATH=1 PYTHONPATH=<tree> .venv/bin/python docs/measured/s26/bits_vs_base.py
# then torch.equal on the two lists. Session 26: 5e8a42b vs 97d99f4 equal in all 8 cases (bf16, f32).
import sys, torch
sys.argv=[sys.argv[0]]
import benchmarks.attention as A
from sluice.attention import create_backend
be = create_backend("cpu")
outs = []
for dtype in (torch.bfloat16, torch.float32):
    for ctxs, qs in (([255]*5, [1]*5), ([1000, 37, 300], [7, 4, 1]), ([1024], [512]), ([0, 17], [40, 3])):
        g = torch.Generator().manual_seed(len(outs))
        case = A.Case("x", ctxs, qs)
        meta, q, k, v, (kc, vc) = A.make_layer(case, dtype, g)
        with torch.inference_mode():
            outs.append(be.forward(q, k, v, kc, vc, meta, 0.125).clone())
torch.save(outs, sys.stdin.readline().strip())
