"""Session 42: output tokens a second in 30 s buckets of each sustained run (from results.json chunk times).
Run from the repository root: python3 docs/measured/s42/buckets.py bench-results/<run>/a/results.json ..."""
import json, sys, numpy as np
for p in sys.argv[1:]:
    r=json.load(open(p))['runs'][0]
    b=np.zeros(21)
    for c in r['calls']:
        ts=c.get('chunk_times') or []
        if not ts or not c['output_tokens']: continue
        per=c['output_tokens']/len(ts)
        for t in ts:
            i=int(t//30)
            if i<21: b[i]+=per
    print(p.split('/')[1][:28], " ".join(f"{x/30:.0f}" for x in b))
