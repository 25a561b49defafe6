#!/usr/bin/env bash
# Session 36: sluice alone, 600 s sustained with `/load` admission, the auto bound steered into a
# lower overhead band (more workflows in flight); then a third workflow-vs-fcfs pair at plenty.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s36 $PY -m sluice.cli serve"
$SL --port 8000 --auto-overhead-band 0.06,0.10 > bench-results/s36-band.server.log 2>&1 &
SP=$!
until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do sleep 2; done
( while kill -0 $SP 2>/dev/null; do echo "$(date +%T) $(curl -s http://127.0.0.1:8000/load)"; sleep 10; done ) > bench-results/s36-band-load-poll.txt 2>&1 &
.venv/bin/sluice bench sustained --base-url http://127.0.0.1:8000/v1 --label sluice-band-0.06-0.10 --admission load \
  --window 600 --quiet --history actual --concurrency 32 --out bench-results/s36-sustained-band
kill $SP; wait $SP 2>/dev/null
echo BANDDONE $(date)
.venv/bin/sluice bench compare --scenario sustained --quiet --history actual --seed 2 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-workflow --a-cmd "$SL --port 8000 --scheduling-policy workflow" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-fcfs --b-cmd "$SL --port 8001 --scheduling-policy fcfs" \
  --window 180 --concurrency 32 --repeats 1 --out bench-results/s36-plenty-workflow-vs-fcfs-3
echo PLENTY3DONE $(date)
