"""Session 42: the overhead the auto bound steers on (steps a second x a fixed cost + idle share) at each
fixed bound of session 41's traces, 20-150 s. Run from the repository root: python3 docs/measured/s42/overhead.py"""
import gzip, json, numpy as np
for n in [4,8,12,16,24]:
    rs=[json.loads(l) for l in gzip.open(f"docs/measured/s41/step-trace-n{n}.jsonl.gz","rt")]
    t=np.array([r["t"] for r in rs]); ms=np.array([r["forward_ms"]+r["post_ms"] for r in rs])
    s=(t-t[0]>20)&(t-t[0]<150); wall=t[s][-1]-t[s][0]
    busy=ms[s].sum()/1e3
    for f in [6.5,7.5,8.5]:
        print(n, f, "steps/s %.1f fixedshare %.3f idle %.3f overhead %.3f"%(s.sum()/wall, s.sum()*f/1e3/wall, 1-busy/wall, s.sum()*f/1e3/wall+max(0,1-busy/wall)))
