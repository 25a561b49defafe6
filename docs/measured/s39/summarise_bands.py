"""Summarise replay-bands/: per setting, mean over seeds of modelled throughput, generation speed
p50, TTFT p50/p90 (all calls), later calls' TTFT p50, workflows in flight; then each seed's numbers.
    python docs/measured/s39/summarise_bands.py docs/measured/s39/replay-bands
"""
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

d = Path(sys.argv[1])
rows = defaultdict(list)
for txt in sorted(d.glob("*.txt")):
    label, seed = txt.stem.rsplit("-s", 1)
    text = txt.read_text()
    m = re.search(r"aggregate ([\d.]+) tok/s, generation speed p50 ([\d.]+) tok/s, TTFT p50 ([\d.]+) s p90 ([\d.]+)", text)
    f = re.search(r"in flight per step: mean ([\d.]+)", text)
    if not m:
        continue
    calls = [json.loads(line) for line in (d / f"{label}-s{seed}.calls.jsonl").open()]
    ttft = [c["first"] - c["submit"] for c in calls]
    later = [c["first"] - c["submit"] for c in calls if not c["id"].endswith("-s0")]
    q = statistics.quantiles(ttft, n=10)
    rows[label].append((int(seed), float(m[1]), float(m[2]), statistics.median(ttft), q[8],
                        statistics.median(later), float(f[1]) if f else float("nan")))
print(f"{'setting':12} n  thr    gen   | p50   p90   later-p50 | in flight | per seed thr / p50")
for label, rs in rows.items():
    mean = [statistics.mean(r[i] for r in rs) for i in range(1, 7)]
    per = "  ".join(f"s{r[0]}: {r[1]:.1f} / {r[3]:.3f}" for r in sorted(rs))
    print(f"{label:12} {len(rs)} {mean[0]:6.1f} {mean[1]:5.1f} | {mean[2]:.3f} {mean[3]:.3f} {mean[4]:.3f}     | "
          f"{mean[5]:5.1f}     | {per}")
