"""Which calls make the TTFT tail: a replay's --calls-out and --step-trace (same run) joined.

    .venv/bin/python benchmarks/engine_replay.py --workflows 96 --concurrency 32 --max-active-workflows 16 \
        --history actual --admission load --speculative-config '{"method": "ngram"}' \
        --step-trace tr.jsonl --calls-out calls.jsonl
    python3 tail_calls.py calls.jsonl tr.jsonl
"""
import json
import statistics as st
import sys

calls = [json.loads(line) for line in open(sys.argv[1])]
steps = [json.loads(line) for line in open(sys.argv[2])]
sched = {}
for i, s in enumerate(steps):
    for rid, n in s["ids"]:
        sched.setdefault(rid, []).append((i, n))
# The calls' clock (the replay's t0) against the trace's (perf_counter): a call's first token
# comes at the end of the step that completes its prompt.
offs = []
for c in calls:
    new, acc = c["prompt_tokens"] - c["cached_tokens"], 0
    for i, n in sched[c["id"]]:
        acc += n
        if acc >= new:
            break
    offs.append(c["first"] - (steps[i]["t"] + steps[i]["forward_ms"] / 1e3))
off = st.median(offs)
rows = []
for c in calls:
    s0 = steps[sched[c["id"]][0][0]]
    sub = c["submit"] - off
    between = [s for s in steps if sub < s["t"] < s0["t"]]
    rows.append((c["first"] - c["submit"], s0["t"] - sub, c["prompt_tokens"] - c["cached_tokens"],
                 c["prompt_tokens"], s0["forward_ms"],
                 [(b["prefill_tokens"], b["decodes"], b["draft_tokens"], round(b["forward_ms"])) for b in between]))
rows.sort()
n = len(rows)
top = rows[int(0.9 * n):]
print(f"{n} calls, TTFT p50 {rows[n // 2][0]:.3f} s, p90 {rows[int(0.9 * n)][0]:.3f} s")
print(f"submit to the call's first step: median {st.median(r[1] for r in rows):.3f} s, "
      f"over the slowest 10% {st.median(r[1] for r in top):.3f} s")
print(f"new prompt tokens: median {st.median(r[2] for r in rows)}, slowest 10% {st.median(r[2] for r in top)}")
print("slowest 10%, every third: TTFT, wait before its first step, new / whole prompt, its step's ms, "
      "steps started while it waited as (prompt tokens, decodes, drafts, ms)")
for r in top[::3]:
    print(f"{r[0]:.3f}  wait {r[1]:.3f}  new {r[2]} / {r[3]}  own step {r[4]:.0f} ms  {len(r[5])} steps {r[5][:6]}")
