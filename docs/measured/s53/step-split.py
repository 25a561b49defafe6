"""Session 53: where a loaded step's time goes on this host at the current code, session 37's split
(docs/measured/s37/step-split.txt) of an engine replay's step trace: least squares of each step's
forward time on its prompt tokens, prompt tokens x their context (1k tokens; a step's chunks share
its summed context evenly, as session 41's fits.py), decode and draft rows, decode context (1k
tokens) and one per step.
    .venv/bin/python docs/measured/s53/step-split.py TRACE.jsonl"""
import json, sys
import numpy as np
rs = [json.loads(l) for l in open(sys.argv[1])]
y = np.array([r["forward_ms"] for r in rs])
pt = np.array([r["prefill_tokens"] for r in rs], float)
pattn = pt * np.array([r["prefill_ctx"] / max(1, r["prefills"]) for r in rs]) / 1e3
rows = np.array([r["decodes"] + r["draft_tokens"] for r in rs], float)
dctx = np.array([r["decode_ctx"] for r in rs], float) / 1e3
x = np.column_stack([pt, pattn, rows, dctx, np.ones(len(y))])
c = np.linalg.lstsq(x, y, rcond=None)[0]
r2 = 1 - ((y - x @ c) ** 2).sum() / ((y - y.mean()) ** 2).sum()
names = ["ms per prompt token", "ms per prompt token per 1k context", "ms per decode or draft row",
         "ms per 1k tokens of decode context", "ms per step"]
for n, ci, col in zip(names, c, x.T):
    print(f"{n:38s} {ci:7.3f} {ci * col.sum() / 1e3:7.1f} s  {100 * ci * col.sum() / y.sum():5.1f}%")
print(f"forward total {y.sum() / 1e3:.1f} s over {len(y)} steps, R^2 {r2:.3f}")
kinds = {"prompt only": (pt > 0) & (rows == 0), "mixed": (pt > 0) & (rows > 0), "decode only": (pt == 0) & (rows > 0)}
for k, m in kinds.items():
    if m.sum():
        print(f"{k:12s} {m.sum():5d} steps, {y[m].sum() / 1e3:6.1f} s, mean {y[m].mean():6.0f} ms, prompt tokens {pt[m].mean():5.0f}, "
              f"decodes {np.mean([r['decodes'] for r, mm in zip(rs, m) if mm]):4.1f}, drafts {np.mean([r['draft_tokens'] for r, mm in zip(rs, m) if mm]):4.1f}")
