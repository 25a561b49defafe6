"""Session 53: least squares against trimmed (3 MAD, refit) and Huber fits of the step-cost model over every
sliding 512-step window (stride 32) of session 41's fixed-bound traces: intercept percentiles 0/10/50/90/100 in ms.
Run from the repository root: .venv/bin/python docs/measured/s53/robust-fits.py"""
import gzip, json, os, sys, numpy as np
sys.path.insert(0, "docs/measured/s41")
HERE="docs/measured/s41"
def load(n):
    rs = [json.loads(l) for l in gzip.open(os.path.join(HERE, f"step-trace-n{n}.jsonl.gz"), "rt")]
    t = np.array([r["t"] for r in rs])
    ms = np.array([r["forward_ms"] + r["post_ms"] for r in rs])
    rows = np.array([r["decodes"] + r["draft_tokens"] for r in rs], float)
    pt = np.array([r["prefill_tokens"] for r in rs], float)
    pattn = pt * np.array([r["prefill_ctx"] / max(1, r["prefills"]) for r in rs]) / 1e3
    dctx = np.array([r["decode_ctx"] for r in rs], float) / 1e3
    return t, ms, np.column_stack([np.ones(len(t)), rows, pt, pattn, dctx])
def ls(x,y): return np.linalg.lstsq(x,y,rcond=None)[0]
def trimmed(x,y,k=3.0,it=3):
    keep=np.ones(len(y),bool)
    for _ in range(it):
        c=ls(x[keep],y[keep]); r=y-x@c
        mad=np.median(np.abs(r[keep]-np.median(r[keep])))*1.4826
        nk=np.abs(r)<=k*max(mad,1e-9)
        if (nk==keep).all(): break
        keep=nk
    return c
def huber(x,y,k=1.345,it=20):
    c=ls(x,y)
    for _ in range(it):
        r=y-x@c; s=np.median(np.abs(r))*1.4826+1e-9
        w=np.minimum(1,k*s/np.maximum(np.abs(r),1e-12))
        sw=np.sqrt(w); c=ls(x*sw[:,None],y*sw)
    return c
for n in [4,8,12,16,24]:
    t,ms,x=load(n)
    out={"ls":[], "trim":[], "huber":[]}
    for s in range(0,len(t)-512,32):
        xx,yy=x[s:s+512],ms[s:s+512]
        out["ls"].append(ls(xx,yy)[0]); out["trim"].append(trimmed(xx,yy)[0]); out["huber"].append(huber(xx,yy)[0])
    print(n, {k:np.round(np.percentile(v,[0,10,50,90,100]),2).tolist() for k,v in out.items()})
