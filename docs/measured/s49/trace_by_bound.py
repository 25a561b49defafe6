"""Session 49: where a sustained step's time goes at each fixed bound (step traces from
collect-bounds.sh). Per bound: steps/s, busy share, output tokens per busy second, what each step
carries, and the part of the wall clock a step's fixed cost (FIXED_MS, the controller's kept fit
on this host: ~14 ms) and idling take (the controller's overhead O)."""
import gzip, json, sys
import numpy as np

FIXED_MS = float(sys.argv[1])
for path in sys.argv[2:]:
    op = gzip.open if path.endswith(".gz") else open
    rows = [json.loads(l) for l in op(path, "rt")]
    t0 = rows[0]["t"]
    rows = [r for r in rows if r["t"] - t0 > 45]          # past the climb-in
    span = rows[-1]["t"] - rows[0]["t"]
    fw = np.array([r["forward_ms"] for r in rows]) / 1e3
    post = np.array([r.get("post_ms", 0) for r in rows]) / 1e3
    dec = np.array([r["decodes"] for r in rows]); drafts = np.array([r["draft_tokens"] for r in rows])
    ptok = np.array([r["prefill_tokens"] for r in rows]); dctx = np.array([r["decode_ctx"] for r in rows])
    wf = np.array([r["workflows"] for r in rows]); run = np.array([r["running"] for r in rows])
    wait = np.array([r["waiting"] for r in rows])
    rows_per = dec + drafts
    busy = fw.sum() / span
    n = len(rows)
    O = (n * FIXED_MS / 1e3 + (span - fw.sum())) / span
    full = (ptok + rows_per >= 500).mean()
    print(f"{path.split('/')[-1]:22s} steps/s {n/span:5.1f} step {1e3*fw.mean():5.1f} ms (p50 {1e3*np.median(fw):5.1f})"
          f" busy {busy:.3f} O {O:.3f} | per step: decodes {dec.mean():5.1f} drafts {drafts.mean():5.1f}"
          f" prompt {ptok.mean():5.1f} dctx {dctx.mean()/1e3:5.1f}k full {full:.2f}"
          f" | in flight {wf.mean():4.1f} running {run.mean():4.1f} waiting {wait.mean():4.1f}")
