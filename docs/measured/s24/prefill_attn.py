# prefill attention microbench: 336 tokens over 1300 prefix (the roofline's case), one thread or two
import sys, time, torch
import os; sys.path.insert(0, os.environ.get("TREE", "/work/main") + "/benchmarks")
import attention as A
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
iters = int(sys.argv[2]) if len(sys.argv) > 2 else 20
case = A.Case("prefill 336 after 1300", [1300], [336])
g = torch.Generator().manual_seed(0)
layers = [A.make_layer(case, torch.bfloat16, g) for _ in range(4)]
backend = A.create_backend("cpu")
scale = 64 ** -0.5
flops = A.attention_flops(case)
best = float("inf")
for _ in range(iters):
    for meta, q, k, v, (kc, vc) in layers:
        t0 = time.perf_counter(); backend.forward(q, k, v, kc, vc, meta, scale); dt = time.perf_counter() - t0
        best = min(best, dt)
print(f"prefill 336/1300 threads={torch.get_num_threads()} best {best*1e3:.3f} ms  {flops/best/1e9:.1f} GFLOP/s")
