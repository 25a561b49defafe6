import torch, time, sys
torch.set_num_threads(2)
from sluice.attention.cpu import extension
extension.load_extension()
from sluice.model.packed_linear import PackedLinear
shapes = [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]
torch.manual_seed(0)
layers = []
for i in range(30):
    layers.append([PackedLinear((torch.randn(n, k) / k ** 0.5).bfloat16(), None, silu_mul=silu) for k, n, silu in shapes])
def step(x576, x1536):
    for l in layers:
        l[0](x576); l[1](x576); l[2](x576); l[3](x1536)
def best(fn, rep=25):
    fn(); ts = []
    for _ in range(rep):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[0], ts[len(ts)//2]
wbytes = 2 * 30 * sum(k * n for k, n, _ in shapes)
for m in [int(a) for a in sys.argv[1:]] or [1, 8, 32]:
    x576 = torch.randn(m, 576).bfloat16(); x1536 = torch.randn(m, 1536).bfloat16()
    b, med = best(lambda: step(x576, x1536))
    print(f"rows {m:4d}: best {b*1e3:6.2f} ms ({wbytes/b/1e9:5.1f} GB/s), median {med*1e3:6.2f} ms")
