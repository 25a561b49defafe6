#!/usr/bin/env bash
# Session 46 (Intel with AMX, family 6 model 167): issue 4's "without pressure, no loss against
# fcfs", first time on this host type: session 36's command (sustained, closed loop, c=32, default
# KV, 180 s windows), two interleaved pairs; sluice from /work/wt-s46 (a snapshot of main).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s46 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --quiet --history actual --seed 2 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-workflow --a-cmd "$SL --port 8000 --scheduling-policy workflow" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-fcfs --b-cmd "$SL --port 8001 --scheduling-policy fcfs" \
  --window 180 --concurrency 32 --repeats 2 --out bench-results/s46-plenty-workflow-vs-fcfs
cp bench-results/s46-plenty-workflow-vs-fcfs/compare.md docs/measured/s46/plenty-workflow-vs-fcfs.md
echo PLENTYDONE $(date -u +%T)
