# decode attention, one layer repeated (K/V stay in L3): CASE=b,ctx Q=query tokens N=calls R=rounds T=threads
# PYTHONSAFEPATH=1 PYTHONPATH=<tree> CASE=32,256 N=1000 R=2 .venv/bin/python docs/measured/s26/decode_loop.py
import sys, os, time, torch
sys.argv=[sys.argv[0]]
import benchmarks.attention as A
from sluice.attention import create_backend
torch.set_num_threads(int(os.environ.get('T','1')))
be = create_backend("cpu")
g = torch.Generator().manual_seed(0)
b, ctx = map(int, os.environ.get('CASE','32,256').split(','))
q = int(os.environ.get('Q','1'))
case = A.Case(f"b={b} ctx={ctx} q={q}", [ctx-q]*b, [q]*b)
layer = A.make_layer(case, torch.bfloat16, g)
with torch.inference_mode():
    for rep in range(int(os.environ.get('R','3'))):
        t = A.time_layer(be, [layer], int(os.environ.get('N','50')), time.thread_time if torch.get_num_threads()==1 else time.perf_counter)
        print(f"{case.label}: {t*1e6:.0f} us {A.attention_flops(case)/t/1e9:.1f} GFLOP/s")
