#!/usr/bin/env bash
# Session 43: the A/B pair again, the old server first (702c00f as A, this session's as B), with
# the CPU time of every thread of the servers and of the bench client sampled every 30 s.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s43-ab2
mkdir -p $OUT
NEW="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s43 $PY -m sluice.cli serve"
OLD="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-old $PY -m sluice.cli serve"
( while true; do
    pids=$(pgrep -f "sluice.cli serve|sluice bench" | tr '\n' ' ')
    [ -n "$pids" ] && $PY docs/measured/s43/threads.py $pids 2>/dev/null
    sleep 30
  done ) > docs/measured/s43/ab2-threads.jsonl &
SAMPLER=$!
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-702c00f --a-cmd "$OLD --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label sluice-s43 --b-cmd "$NEW --port 8100" \
  --repeats 1 --out $OUT
kill $SAMPLER
grep "workflow bound" $OUT/a.server.log > docs/measured/s43/ab2-old-bound-log.txt
grep "workflow bound" $OUT/b.server.log > docs/measured/s43/ab2-new-bound-log.txt
echo AB2DONE $(date)
