#!/usr/bin/env bash
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s43-cpu
env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s43 $PY -m sluice.cli serve --port 8002 --step-trace $OUT/trace.jsonl > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
.venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window 150 --concurrency 32 --repeats 1 --out $OUT/bench > $OUT/bench.txt 2>&1 &
BP=$!
sleep 30
$PY docs/measured/s43/threads.py $SP $BP > $OUT/snap1.json
sleep 100
$PY docs/measured/s43/threads.py $SP $BP > $OUT/snap2.json
wait $BP
kill $SP; wait $SP
echo CPUDONE
