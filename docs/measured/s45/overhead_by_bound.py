"""Session 45: the overhead the auto bound steers by (engine/admission.py: steps x the fitted fixed
cost, plus idle time, over the wall clock), read from the fixed-bound step traces of collect-bounds.sh
with each trace's own StepCostModel, over the steady part (20 s in to the end of the window).
    .venv/bin/python docs/measured/s45/overhead_by_bound.py bench-results/s45-bounds/trace-n*.jsonl"""
import json, sys
from sluice.engine.admission import StepCostModel, StepShape

for path in sys.argv[1:]:
    rs = [json.loads(l) for l in open(path)]
    m = StepCostModel()
    t0 = rs[0]["t"]
    steps = busy = 0
    first = last = None
    for r in rs:
        ms = r["forward_ms"] + r["post_ms"]
        pt = r["prefill_tokens"]
        pattn = pt * (r["prefill_ctx"] / max(1, r["prefills"]) + pt / max(1, r["prefills"]) / 2) / 1e3
        m.observe(StepShape(r["decodes"] + r["draft_tokens"], pt, pattn, r["decode_ctx"] / 1e3), ms / 1e3)
        if 20 < r["t"] - t0 < 180:
            first = r["t"] if first is None else first
            last = r["t"] + ms / 1e3
            steps += 1
            busy += ms / 1e3
    fixed = m.fixed_cost()
    wall = last - first
    print(f"{path}: {steps} steps over {wall:.0f} s, fixed cost {fixed * 1e3:.1f} ms (kept-fit scale "
          f"{m.scale if m.scale is not None else float('nan'):.2f}), idle {1 - busy / wall:.1%}, "
          f"overhead {(steps * fixed + wall - busy) / wall:.3f}")
