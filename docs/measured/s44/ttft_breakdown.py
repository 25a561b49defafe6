import json, sys, statistics as st
def q(xs, p):
    xs = sorted(xs); return xs[min(len(xs)-1, int(p*len(xs)))] if xs else float('nan')
for path in sys.argv[1:]:
    calls = [c for c in json.load(open(path))["runs"][0]["calls"] if c["status"] == "ok" and c["first_token_time"]]
    print(path)
    groups = {"first call": [c for c in calls if c["step_index"] == 0], "follow-up": [c for c in calls if c["step_index"] > 0]}
    for lo, hi in ((0, 200), (200, 400), (400, 700), (700, 100000)):
        groups[f"uncached {lo}-{hi}"] = [c for c in calls if lo <= c["prompt_tokens"] - (c["cached_tokens"] or 0) < hi]
    for k, cs in groups.items():
        t = [c["first_token_time"] - c["send_time"] for c in cs]
        print(f"  {k:>18}: n={len(cs):5d} ttft p50 {q(t,.5):.3f} p90 {q(t,.9):.3f}")
