"""Session 53: which calls make the TTFT tail in session 52's sustained pair (bench-results/s52-sustained/pair,
a = sluice, b = vLLM; calls sent after 30 s): first calls against later ones, and TTFT by new (uncached) prompt tokens.
Run from the repository root (the results are not in the repository: bench-results/ is ignored)."""
import json, sys
import numpy as np
base = sys.argv[1] if len(sys.argv) > 1 else "bench-results/s52-sustained/pair"
for lab in "ab":
    d = json.load(open(f"{base}/{lab}/results.json"))
    c = [x for x in d["runs"][0]["calls"] if x["status"] == "ok" and x["send_time"] > 30]
    t = np.array([x["first_token_time"] - x["send_time"] for x in c])
    new = np.array([x["prompt_tokens"] - x["cached_tokens"] for x in c])
    first = np.array([x["step_index"] == 0 for x in c])
    print(lab, len(c), "TTFT p50/p90", np.percentile(t, [50, 90]).round(3), "first calls' share", first.mean().round(3),
          "first p50/p90", np.percentile(t[first], [50, 90]).round(3), "later p50/p90", np.percentile(t[~first], [50, 90]).round(3))
    for lo, hi in [(0, 200), (200, 300), (300, 400), (400, 600), (600, 2000)]:
        m = (new >= lo) & (new < hi)
        if m.sum():
            print("  new tokens", lo, hi, m.sum(), "TTFT p50/p90", np.percentile(t[m], [50, 90]).round(3),
                  "ms per new token p50", np.median(t[m] / np.maximum(new[m], 1) * 1e3).round(2))
    top = t > np.percentile(t, 90)
    print("  slowest 10%: first calls' share", first[top].mean().round(2), "new tokens median", np.median(new[top]), "all", np.median(new))
