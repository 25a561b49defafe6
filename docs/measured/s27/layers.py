# total GEMM time of 30 layers (distinct weights) at R rows, T threads: best of REPS
import sys, time, torch, os
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
torch.set_num_threads(int(os.environ.get("T", "2")))
shapes = [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False)]
g = torch.Generator().manual_seed(0)
ws = [[pack_weight((torch.randn(n, k, generator=g) * .02).to(torch.bfloat16)) for n, k, _ in shapes] for _ in range(30)]
out = []
for rows in [int(r) for r in sys.argv[1].split(",")]:
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
    def run():
        for lw in ws:
            for (n, k, silu), w in zip(shapes, lw):
                (torch.ops.sluice.linear_bf16_silu_mul if silu else torch.ops.sluice.linear_bf16)(xs[k], w, n, None)
    run()
    ts = []
    for _ in range(int(os.environ.get("REPS", "9"))):
        t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
    ts.sort()
    fl = rows * 30 * 2 * sum(n * k for n, k, _ in shapes)
    out.append(f"r{rows} {ts[0]*1e3:.1f}/{ts[len(ts)//2]*1e3:.1f}ms {fl/ts[0]/1e9:.0f}GF")
print(" ".join(out))
