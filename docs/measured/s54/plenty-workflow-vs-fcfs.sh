#!/usr/bin/env bash
# Session 54 (AMD EPYC Zen 4, family 25 model 17): issue 4's "without pressure, no loss against
# fcfs" on this type again (last measured in session 36, before sessions 37-53's scheduler changes):
# session 46's command (sustained, closed loop, c=32, default KV, 180 s windows), three interleaved
# pairs; sluice from /work/wt-s54 (a snapshot of main at 036d100).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s54 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --quiet --history actual --seed 2 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-workflow --a-cmd "$SL --port 8000 --scheduling-policy workflow" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-fcfs --b-cmd "$SL --port 8001 --scheduling-policy fcfs" \
  --window 180 --concurrency 32 --repeats 3 --out bench-results/s54-plenty-workflow-vs-fcfs
cp bench-results/s54-plenty-workflow-vs-fcfs/compare.md docs/measured/s54/plenty-workflow-vs-fcfs.md
echo PLENTYDONE $(date -u +%T)
