"""Session 45: the step-cost model of the virtual-clock replay (benchmarks/engine_replay.py
--step-cost), fitted on this host's step traces from collect-bounds.sh, and the time a step
spends outside its forward (the gap to the next step's start when it follows at once).
    .venv/bin/python docs/measured/s45/fit_steps.py bench-results/s45-bounds/trace-n*.jsonl"""
import json, sys
import numpy as np


def load(path):
    rs = [json.loads(l) for l in open(path)]
    t = np.array([r["t"] for r in rs])
    fwd = np.array([r["forward_ms"] + r["post_ms"] for r in rs])
    rows = np.array([r["decodes"] + r["draft_tokens"] for r in rs], float)
    pt = np.array([r["prefill_tokens"] for r in rs], float)
    # each chunk's context: the trace has the chunks' summed context; ids give the chunk sizes
    pattn = np.array([sum(n for _, n in r["ids"] if n > 1) and
                      (r["prefill_tokens"] * (r["prefill_ctx"] / max(1, r["prefills"]) + r["prefill_tokens"] / max(1, r["prefills"]) / 2))
                      for r in rs], float) / 1e3
    dctx = np.array([r["decode_ctx"] for r in rs], float) / 1e3
    x = np.column_stack([pt, pattn, rows, dctx, np.ones(len(t))])
    gaps = np.diff(t) * 1e3 - fwd[:-1]
    return t, fwd, x, gaps


names = ["ms per prompt token", "ms per prompt token per 1k context", "ms per decode or draft row",
         "ms per 1k tokens of decode context", "ms per step"]
allx, ally, allgaps = [], [], []
for p in sys.argv[1:]:
    t, y, x, gaps = load(p)
    s = (t - t[0] > 20)
    c = np.linalg.lstsq(x[s], y[s], rcond=None)[0]
    pred = x[s] @ c
    r2 = 1 - ((y[s] - pred) ** 2).sum() / ((y[s] - y[s].mean()) ** 2).sum()
    small = gaps[(gaps >= 0) & (gaps < 50)]
    print(f"{p}: {s.sum()} steps, own fit {np.round(c, 3)} R^2 {r2:.3f}; gap to next step median "
          f"{np.median(small):.2f} ms mean {small.mean():.2f}")
    allx.append(x[s]); ally.append(y[s]); allgaps.append(small)
x, y = np.vstack(allx), np.concatenate(ally)
c = np.linalg.lstsq(x, y, rcond=None)[0]
pred = x @ c
r2 = 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()
gap = float(np.median(np.concatenate(allgaps)))
for n, v in zip(names, c):
    print(f"{n:38s} {v:8.3f}")
print(f"pooled over {len(y)} steps, R^2 {r2:.3f}; outside the forward (median gap) {gap:.2f} ms")
kinds = {"prompt only": (x[:, 0] > 0) & (x[:, 2] == 0), "mixed": (x[:, 0] > 0) & (x[:, 2] > 0),
         "decode only": (x[:, 0] == 0)}
for k, m in kinds.items():
    if m.any():
        print(f"{k:12s} {m.sum():5d} steps mean {y[m].mean():6.1f} ms (model {pred[m].mean():6.1f}), prompt tokens "
              f"{x[m, 0].mean():5.0f}, rows {x[m, 2].mean():5.1f}, decode ctx {x[m, 3].mean():5.1f}k")
print("--step-cost " + ",".join(f"{v:.3f}" for v in (c[0], c[1], c[2], c[3], c[4] + gap)))
# where the steps' time went, by the pooled fit's terms (each trace)
for p in sys.argv[1:]:
    t, y, x, gaps = load(p)
    s = (t - t[0] > 20)
    span = (t[s][-1] - t[s][0])
    parts = (x[s] * c).sum(axis=0) / 1e3
    print(f"{p}: {span:.0f} s of steps' wall, forward+post {y[s].sum() / 1e3:.0f} s; " +
          ", ".join(f"{n.replace('ms per ', '')} {v:.0f} s" for n, v in zip(names, parts)))
