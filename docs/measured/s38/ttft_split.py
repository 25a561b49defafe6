"""TTFT of a sustained run split into first and later calls: python ttft_split.py s38-sustained/a ... (bench-results/ dirs)."""
import json, statistics as st, sys
for run in sys.argv[1:]:
    r = json.load(open(f"bench-results/{run}/results.json"))["runs"][0]
    c = [x for x in r["calls"] if x["status"] == "ok"]
    t = lambda xs: [x["first_token_time"] - x["send_time"] for x in xs]
    f = t([x for x in c if x["step_index"] == 0]); l = t([x for x in c if x["step_index"] > 0])
    a = f + l
    steady = t([x for x in c if 60 < x["send_time"] < 600])
    unc = st.median([x["prompt_tokens"] - x["cached_tokens"] for x in c if x["step_index"] > 0])
    q = lambda v: f"{st.median(v):.3f}/{st.quantiles(v, n=10)[8]:.3f}"
    print(f"{run:28s} all {q(a)} first({len(f)}) {q(f)} later({len(l)}) {q(l)} steady60-600 {q(steady)} later-uncached-med {unc}")
