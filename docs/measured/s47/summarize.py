"""One line per run of a bench-results folder: throughput, generation speed, TTFT, drafts."""
import re
import sys
from pathlib import Path

def metric(text, name):
    m = re.search(r"^" + re.escape(name) + r"\{[^}]*\} ([0-9.e+]+)", text, re.M)
    return float(m.group(1)) if m else float("nan")

out = Path(sys.argv[1])
for bench in sorted(out.glob("bench-*.txt"), key=lambda p: p.stat().st_mtime):
    label = bench.stem[len("bench-"):]
    t = bench.read_text()
    def row(name):
        m = re.search(r"\| " + re.escape(name) + r" \| ([0-9.]+)", t)
        return float(m.group(1)) if m else float("nan")
    line = (f"{label:10s} tok/s {row('Aggregate output throughput (tok/s)'):6.1f} gen {row('Per-request generation speed (median) (tok/s)'):5.1f} "
            f"TTFT p50 {row('TTFT p50 (s)'):.3f} p90 {row('TTFT p90 (s)'):.3f} p99 {row('TTFT p99 (s)'):.3f} wf {row('Admitted workflows'):.0f}")
    mf = out / f"metrics-{label}.txt"
    if mf.exists():
        m = mf.read_text()
        d, dt, a = (metric(m, f"sluice:spec_decode_num_{k}_total") for k in ("drafts", "draft_tokens", "accepted_tokens"))
        line += f" | drafts/verif {dt / d:.2f} accepted {100 * a / dt:.1f}% ({a / d:.2f}/verif)"
        q, h = metric(m, "sluice:prefix_cache_queries_total"), metric(m, "sluice:prefix_cache_hits_total")
        line += f" | prefix hits {100 * h / q:.1f}% preemptions {metric(m, 'sluice:num_preemptions_total'):.0f}"
    poll = out / f"load-poll-{label}.txt"
    if poll.exists():
        import json
        active = []
        for raw in poll.read_text().splitlines()[3:]:
            try:
                active.append(json.loads(raw.split(" ", 1)[1])["active_workflows"])
            except (ValueError, KeyError, IndexError):
                pass
        if active:
            line += f" | in flight {sum(active) / len(active):.1f}"
    print(line)
