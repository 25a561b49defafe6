import torch, time
torch.set_num_threads(2)
from sluice.attention.cpu import extension
extension.load_extension()
from sluice.model.packed_linear import PackedLinear
shapes = [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]
torch.manual_seed(0)
for k, n, silu in shapes:
    # 60 distinct copies: ~60 x the weight, far beyond L2, cycled
    ls = [PackedLinear((torch.randn(n, k) / k ** 0.5).bfloat16(), None, silu_mul=silu) for _ in range(60)]
    x = torch.randn(1, k).bfloat16()
    for l in ls: l(x)
    ts = []
    for _ in range(9):
        t = time.perf_counter()
        for l in ls: l(x)
        ts.append((time.perf_counter() - t) / len(ls))
    b = min(ts)
    print(f"K={k} N={n} silu={silu}: {b*1e6:6.1f} us/call, {n*k*2/b/1e9:5.1f} GB/s")
