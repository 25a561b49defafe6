#!/usr/bin/env bash
# Session 43 (AMD Zen 4): sluice with the long-polled /load and the piece cache (/work/wt-s43, at
# main) against sluice before them (/work/wt-old, 702c00f), one 600 s sustained pair, c=32, the
# default auto bound admitting by /load. The bench client is main's for both: against the old
# server its gate falls back to polling /load twice per 0.1 s, as before.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s43-ab
mkdir -p $OUT
NEW="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s43 $PY -m sluice.cli serve"
OLD="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-old $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-s43 --a-cmd "$NEW --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label sluice-702c00f --b-cmd "$OLD --port 8100" \
  --repeats 1 --out $OUT
grep "workflow bound" $OUT/a.server.log > docs/measured/s43/ab-new-bound-log.txt
grep "workflow bound" $OUT/b.server.log > docs/measured/s43/ab-old-bound-log.txt
echo ABDONE $(date)
