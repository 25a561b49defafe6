import torch, time, sys
torch.set_num_threads(2)
from sluice.attention.cpu import extension
extension.load_extension()
from sluice.model.packed_linear import PackedLinear
shapes = [(576, 960, False), (576, 576, False), (576, 3072, True), (576, 3072, False), (1536, 576, False)]
def best(fn, rep=15):
    fn(); b = 1e9
    for _ in range(rep):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b
ms = [int(a) for a in sys.argv[1:]] or [128, 256, 512]
for m in ms:
    for k, n, silu in shapes:
        w = (torch.randn(n, k) / k ** 0.5).bfloat16()
        layer = PackedLinear(w, None, silu_mul=silu)
        x = torch.randn(m, k).bfloat16()
        a = best(lambda: layer(x)); o = best(lambda: x @ w.t())
        f = 2 * m * k * n
        print(f"m={m} k={k} n={n} silu={silu}: packed {a*1e3:.3f} ms {f/a/1e9:.0f} GF/s | oneDNN {o*1e3:.3f} ms {f/o/1e9:.0f} GF/s")
