"""CPU shares per thread between consecutive samples of run-ab2.sh's ab2-threads.jsonl: for each
server process (by pid) and the bench client, the share of a core each thread used over the
longest stretch the process was sampled, 60 s after its first sample on.
Run from the repository root: python3 docs/measured/s43/threads_delta.py"""
import json
rows = [json.loads(l) for l in open("docs/measured/s43/ab2-threads.jsonl")]
procs = {}
for r in rows:
    for pid, threads in r.items():
        if pid == "t":
            continue
        procs.setdefault(pid, []).append((r["t"], threads))
for pid, samples in procs.items():
    t0 = samples[0][0]
    samples = [s for s in samples if s[0] - t0 >= 60] or samples
    (ta, a), (tb, b) = samples[0], samples[-1]
    if tb - ta < 60:
        continue
    shares = {tid: (c[0], (c[1] - a.get(tid, (c[0], 0.0))[1]) / (tb - ta)) for tid, c in b.items()}
    top = sorted(shares.values(), key=lambda x: -x[1])
    print(pid, f"{tb - ta:.0f} s:", ", ".join(f"{name} {100 * s:.1f}%" for name, s in top if s > 0.002))
