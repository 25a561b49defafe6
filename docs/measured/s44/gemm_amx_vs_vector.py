import torch, time, sys
torch.set_num_threads(2)
from sluice.attention.cpu import extension
extension.load_extension()
from sluice.model.packed_linear import PackedLinear
shapes = [(576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)]
layers = []
for k, n, silu in shapes:
    w = (torch.randn(n, k) / k ** 0.5).bfloat16()
    layers.append([PackedLinear(w, None, silu_mul=silu) for _ in range(30)])
lm = PackedLinear((torch.randn(49152, 576) / 24).bfloat16(), None)
def step(x576, x1536):
    for i in range(30):
        layers[0][i](x576); layers[1][i](x576); layers[2][i](x576); layers[3][i](x1536)
def best(fn, rep=7):
    fn(); b = 1e9
    for _ in range(rep):
        t = time.perf_counter(); fn(); b = min(b, time.perf_counter() - t)
    return b
ms = [int(a) for a in sys.argv[1:]] or [1, 4, 8, 16, 32, 64, 128, 256, 512]
print(f"{'rows':>5} {'avx512 ms':>10} {'amx ms':>8} {'ratio':>6} {'amx GFLOP/s':>11} | lm head avx / amx ms")
flop_row = 2 * 30 * sum(k * n for k, n, _ in shapes)
for m in ms:
    x576 = torch.randn(m, 576).bfloat16(); x1536 = torch.randn(m, 1536).bfloat16()
    torch.ops.sluice.linear_set_amx(False); a = best(lambda: step(x576, x1536)); la = best(lambda: lm(x576))
    torch.ops.sluice.linear_set_amx(True); b = best(lambda: step(x576, x1536)); lb = best(lambda: lm(x576))
    print(f"{m:5d} {a*1e3:10.2f} {b*1e3:8.2f} {a/b:6.2f} {flop_row*m/b/1e9:11.0f} | {la*1e3:.2f} / {lb*1e3:.2f}")
