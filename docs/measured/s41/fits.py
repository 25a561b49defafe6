"""Session 41: the step-cost fit on the fixed-bound traces (step-trace-n*.jsonl.gz, from
collect-traces.sh). For each bound: the intercept of the window's own least-squares fit (what the
model gave until s40), and what StepCostModel gives when the traces are replayed through it in
order 4 -> 24 -> 4 (the bound climbing and falling). Step time here is the trace's forward + post
(the engine times the step from before `schedule()`, a little more).
Run from the repository root: .venv/bin/python docs/measured/s41/fits.py"""
import gzip, json, os, numpy as np
from sluice.engine.admission import StepCostModel, StepShape

HERE = os.path.dirname(os.path.abspath(__file__))


def load(n):
    rs = [json.loads(l) for l in gzip.open(os.path.join(HERE, f"step-trace-n{n}.jsonl.gz"), "rt")]
    t = np.array([r["t"] for r in rs])
    ms = np.array([r["forward_ms"] + r["post_ms"] for r in rs])
    rows = np.array([r["decodes"] + r["draft_tokens"] for r in rs], float)
    pt = np.array([r["prefill_tokens"] for r in rs], float)
    # prompt tokens x the context they attend to (the trace has the chunks' summed context only)
    pattn = pt * np.array([r["prefill_ctx"] / max(1, r["prefills"]) for r in rs]) / 1e3
    dctx = np.array([r["decode_ctx"] for r in rs], float) / 1e3
    return t, ms, np.column_stack([np.ones(len(t)), rows, pt, pattn, dctx])


BOUNDS = [4, 8, 12, 16, 24]
data = {n: load(n) for n in BOUNDS}
print("bound  steps/s  rows p25/50/75   own fit over the steady part (ms: fixed, row, prompt, pattn, dctx)")
for n in BOUNDS:
    t, ms, x = data[n]
    s = (t - t[0] > 20) & (t - t[0] < 150)
    c = np.linalg.lstsq(x[s], ms[s], rcond=None)[0]
    dec = x[s & (x[:, 1] > 0), 1]
    print(f"{n:5d} {s.sum() / 130:8.1f}  {np.percentile(dec, [25, 50, 75])}  {np.round(c, 3)}")

print("\nreplayed through StepCostModel (fixed cost every 64 steps, ms)")
m = StepCostModel()
for n in BOUNDS + BOUNDS[-2::-1]:
    t, ms, x = data[n]
    out, scales = [], []
    for i in range(len(t)):
        m.observe(StepShape(int(x[i, 1]), int(x[i, 2]), float(x[i, 3]), float(x[i, 4])), ms[i] / 1e3)
        if i % 64 == 63:
            f = m.fixed_cost()
            out.append(np.nan if f is None else f * 1e3)
            scales.append(np.nan if m.scale is None else m.scale)
    print(f"bound {n:2d}: p10/50/90 {np.round(np.nanpercentile(out, [10, 50, 90]), 2)}  "
          f"kept-fit scale {np.round(np.nanmedian(scales), 3) if np.isfinite(scales).any() else '-'}")
