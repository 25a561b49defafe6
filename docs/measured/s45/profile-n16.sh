#!/usr/bin/env bash
# Session 45: py-spy over the server's engine during a sustained run at a fixed bound of 16.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s45-profile
mkdir -p $OUT
env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s45 $PY -m sluice.cli serve --port 8002 --max-active-workflows 16 > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
.venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
  --window 150 --concurrency 32 --repeats 1 --out $OUT/bench > $OUT/bench.txt 2>&1 &
BP=$!
sleep 40
/tmp/pyspy/py_spy-0.4.3.data/scripts/py-spy record -p $SP -d 90 -r 50 -f raw -o $OUT/profile.txt ${NATIVE:-} > $OUT/pyspy.log 2>&1
wait $BP
kill $SP; wait $SP
echo PROFILEDONE
