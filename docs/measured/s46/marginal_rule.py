"""Session 46: would a marginal rule for the auto workflow bound (raise while one more workflow buys
> theta of throughput: b / N^2 / (1 - O(N)) with O(N) = a + b / N fitted over the bounds visited)
land where the vLLM-relative targets are met on both host types seen? The overhead O is read the
way the controller reads it (steps x one kept fixed cost + idle, over the wall clock).
  Zen 4 (s41 step traces at fixed bounds 4-24; kept fixed cost 7.5 ms, what the kept fit read there)
  AMX (s45: the periods the auto run logged while it climbed, kept fit 11.5-12.4 ms)
    .venv/bin/python docs/measured/s46/marginal_rule.py"""
import gzip, json, math
import numpy as np

def overhead_from_trace(path, fixed_s, t_lo=20, t_hi=180):
    rs = [json.loads(l) for l in gzip.open(path, "rt")]
    t0 = rs[0]["t"]
    sel = [r for r in rs if t_lo < r["t"] - t0 < t_hi]
    busy = sum((r["forward_ms"] + r["post_ms"]) / 1e3 for r in sel)
    wall = sel[-1]["t"] + (sel[-1]["forward_ms"] + sel[-1]["post_ms"]) / 1e3 - sel[0]["t"]
    return (len(sel) * fixed_s + wall - busy) / wall

def fit(ns, os_):
    x = np.c_[np.ones(len(ns)), 1.0 / np.asarray(ns, float)]
    (a, b), *_ = np.linalg.lstsq(x, np.asarray(os_), rcond=None)
    return a, b

def n_star(a, b, theta):
    # b / N^2 / (1 - a - b / N) = theta  <=>  (1 - a) N^2 - b N - b / theta = 0
    return (b + math.sqrt(b * b + 4 * (1 - a) * b / theta)) / (2 * (1 - a))

zen4 = {n: overhead_from_trace(f"docs/measured/s41/step-trace-n{n}.jsonl.gz", 7.5e-3) for n in (4, 8, 12, 16, 24)}
print("Zen 4, O by bound:", {n: round(o, 3) for n, o in zen4.items()})
# the periods of the s45 AMX auto run (docs/measured/s45/auto-bound-log.txt): in flight at the period's end, its overhead
amx = {8: 0.404, 11: 0.319, 15: 0.224, 18: 0.233, 22: 0.181, 27: 0.166}
print("AMX, O by workflows in flight (single 5 s periods):", amx)
for name, pts in (("Zen 4 (8-24)", {n: o for n, o in zen4.items() if n >= 8}), ("Zen 4 (4-24)", zen4), ("AMX", amx)):
    a, b = fit(list(pts), list(pts.values()))
    print(f"{name}: O = {a:.3f} + {b:.2f} / N;  N* at theta 0.5% / 1% / 1.5% / 2%: "
          + " / ".join(f"{n_star(a, b, t):.1f}" for t in (0.005, 0.01, 0.015, 0.02)))
print("where the targets were met: Zen 4 12-13 in flight (s39-s42 pairs), AMX 14-16 (s45 pairs)")
