#!/usr/bin/env bash
# Session 47: perf over the server at bound 16 during a sustained c=32 run, samples split by thread:
# which thread waits in OpenMP, and what the main thread runs meanwhile.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s47-perf${TAG:-}
mkdir -p $OUT
env PYTHONSAFEPATH=1 PYTHONPATH=${WT:-/work/wt-s47} $PY -m sluice.cli serve --port 8002 --max-active-workflows 16 > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
.venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
  --window 100 --concurrency 32 --repeats 1 --out $OUT/bench > $OUT/bench.txt 2>&1 &
BP=$!
sleep 40
/usr/bin/perf record -F 1999 -p $SP -o $OUT/perf.data -- sleep 30 > $OUT/perf.log 2>&1
wait $BP
kill $SP; wait $SP
/usr/bin/perf report -i $OUT/perf.data --sort tid --stdio > $OUT/by-tid.txt 2>/dev/null
/usr/bin/perf report -i $OUT/perf.data --sort tid,sym --stdio > $OUT/by-tid-sym.txt 2>/dev/null
echo PERFDONE
