#!/usr/bin/env bash
# Session 29: issue 4 pressure rerun (600 s windows, the s28 script), then workflow vs fcfs without
# pressure on this CPU type (default 1 GiB KV, both closed loop, 180 s windows, 2 interleaved pairs).
set -u
cd /work/main
bash docs/measured/s28/pressure-long-script-not-run.sh
PY=/work/main/.venv/bin/python
.venv/bin/sluice bench compare --scenario sustained --quiet --history actual \
  --a http://127.0.0.1:8000/v1 --a-label sluice-workflow --a-cmd "$PY -m sluice.cli serve --port 8000 --scheduling-policy workflow" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-fcfs --b-cmd "$PY -m sluice.cli serve --port 8001 --scheduling-policy fcfs" \
  --window 180 --concurrency 32 --repeats 2 --out bench-results/s29/plenty-workflow-vs-fcfs
echo PLENTYDONE
