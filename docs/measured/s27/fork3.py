import time, torch, threading, ctypes, os
from sluice.attention.cpu.extension import load_extension
from sluice.model.packed_linear import pack_weight
load_extension()
gomp = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
w = pack_weight(torch.randn(64, 40, dtype=torch.bfloat16)); x = torch.randn(8, 40, dtype=torch.bfloat16)
def b(tag):
    for _ in range(100): torch.ops.sluice.linear_bf16(x, w, 64, None)
    best = 1e9
    for _ in range(20):
        t = time.perf_counter()
        for _ in range(1000): torch.ops.sluice.linear_bf16(x, w, 64, None)
        best = min(best, time.perf_counter() - t)
    print(f"{tag}: {best*1e3:.2f} us/call", flush=True)
b("main")
th = threading.Thread(target=b, args=("thread before pause",)); th.start(); th.join()
print("pause:", gomp.omp_pause_resource_all(1))
th = threading.Thread(target=b, args=("thread after pause",)); th.start(); th.join()
th = threading.Thread(target=b, args=("thread after pause 2",)); th.start(); th.join()
