# decode attention per layer with one layer's K/V repeated (stays in L3: compute-bound); T threads (default 1)
# PYTHONSAFEPATH=1 PYTHONPATH=<tree> T=1 .venv/bin/python docs/measured/s25/decode_l3.py
import sys, time, torch
sys.argv=[sys.argv[0]]
import benchmarks.attention as A
from sluice.attention import create_backend
torch.set_num_threads(int(__import__('os').environ.get('T','1')))
be = create_backend("cpu")
g = torch.Generator().manual_seed(0)
clock = time.thread_time if torch.get_num_threads()==1 else time.perf_counter
for ctx, b in ((256,32),(256,8),(2048,4),(2048,32)):
    case = A.Case(f"decode b={b} ctx={ctx}", [ctx-1]*b, [1]*b)
    layer = A.make_layer(case, torch.bfloat16, g)
    with torch.inference_mode():
        t = A.time_layer(be, [layer], 50, clock)
    nb = A.kv_bytes(case, torch.bfloat16)
    print(f"{case.label}: same layer repeated {t*1e6:.0f} us  {nb/t/1e9:.1f} GB/s  {A.attention_flops(case)/t/1e9:.1f} GFLOP/s  KV {nb/1e6:.1f} MB")
