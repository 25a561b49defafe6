"""Output (decodes + 0.83 x drafts, the run's acceptance) and prompt tokens per second over the
first 30/50/70/100% of each step trace, skipping its first 10 s.
Usage: python docs/measured/s33/steady.py TRACE.jsonl ..."""
import json, sys
import numpy as np
for path in sys.argv[1:]:
    steps = [json.loads(l) for l in open(path)]
    t = np.array([r["t"] for r in steps]); T = t[-1] - t[0]
    for frac in (0.3, 0.5, 0.7, 1.0):
        sel = [r for r in steps if r["t"] - t[0] <= frac * T and r["t"] - t[0] >= 10]
        dt = sel[-1]["t"] - sel[0]["t"]
        dec = sum(r["decodes"] for r in sel); dr = sum(r["draft_tokens"] for r in sel)
        pt = sum(r["prefill_tokens"] for r in sel)
        print(f"{path.split('/')[-1]:28s} first {frac:.0%} ({dt:5.0f} s): ~output {(dec+0.83*dr)/dt:5.1f} tok/s, prompt {pt/dt:5.0f} tok/s, wf {np.mean([r.get('workflows',0) for r in sel]):.1f}")
