"""The auto bound's overhead signal over step traces (engine_replay.py --step-trace), in 5 s
periods over the first 80% of each run: steps x the fixed cost (fit over the whole trace, or
F_MS=19.3 to use one value for all) plus idle, over the wall clock.
Usage (repository root, traces gunzipped): F_MS=19.3 .venv/bin/python docs/measured/s33/overhead.py TRACE.jsonl ..."""
import json, sys
import numpy as np
from sluice.engine.admission import StepCostModel, StepShape

for path in sys.argv[1:]:
    steps = [json.loads(l) for l in open(path)][5:]
    m = StepCostModel(window=100000)
    for r in steps:
        p, pt = r["prefills"], r["prefill_tokens"]
        att = pt * (r["prefill_ctx"] / p + pt / (2 * p)) / 1e3 if p else 0.0
        m.observe(StepShape(r["decodes"] + r["draft_tokens"], pt, att, r["decode_ctx"] / 1e3),
                  (r["forward_ms"] + r["post_ms"]) / 1e3)
    F = float(__import__("os").environ.get("F_MS", "nan")) / 1e3
    if F != F: F = m.fixed_cost()
    t = np.array([r["t"] for r in steps])
    dur = np.array([(r["forward_ms"] + r["post_ms"]) / 1e3 for r in steps])
    # 5 s periods over the steady part (skip the last 20% = drain tail)
    t0, t1 = t[0], t[0] + 0.8 * (t[-1] - t[0])
    ovs = []
    edges = np.arange(t0, t1, 5.0)
    for a, b in zip(edges[:-1], edges[1:]):
        sel = (t >= a) & (t < b)
        n = sel.sum()
        busy = dur[sel].sum()
        ovs.append((n * F + max(0, 5.0 - busy)) / 5.0)
    ovs = np.array(ovs)
    wf = np.mean([r.get("workflows", 0) for r in steps])
    print(f"{path}: F {F*1e3:.1f} ms, steps {len(steps)}, mean wf {wf:.1f}, overhead mean {ovs.mean():.1%} "
          f"p25 {np.percentile(ovs,25):.1%} p75 {np.percentile(ovs,75):.1%}; whole: steps*F {len(steps)*F:.0f} s, "
          f"busy {dur.sum():.0f} s of {t[-1]-t[0]:.0f} s")
