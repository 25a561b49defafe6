import sys, time, statistics, torch
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
shapes = [("qkv", 960, 576, False), ("o", 576, 576, False), ("gu", 3072, 576, True), ("down", 576, 1536, False)]
L = 30
ws = {name: [pack_weight(torch.randn(n, k, dtype=torch.bfloat16) * .02) for _ in range(L)] for name, n, k, _ in shapes}
rows = int(sys.argv[1]); reps = int(sys.argv[2])
xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}
def layers():
    for i in range(L):
        for name, n, k, silu in shapes:
            op = torch.ops.sluice.linear_bf16_silu_mul if silu else torch.ops.sluice.linear_bf16
            op(xs[k], ws[name][i], n, None)
layers()
ts = []
for _ in range(reps):
    t = time.perf_counter(); layers(); ts.append(time.perf_counter() - t)
fl = rows * L * 2 * sum(n * k for _, n, k, _ in shapes)
print(f"rows {rows}: mean {fl/statistics.mean(ts)/1e9:6.1f} median {fl/statistics.median(ts)/1e9:6.1f} best {fl/min(ts)/1e9:6.1f} GF/s")
