#!/usr/bin/env bash
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s43-spy
mkdir -p $OUT
env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s43 $PY -m sluice.cli serve --port 8002 > $OUT/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
.venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window 120 --concurrency 32 --repeats 1 --out $OUT/bench > $OUT/bench.txt 2>&1 &
BP=$!
sleep 30
/tmp/pyspy/py_spy-0.4.3.data/scripts/py-spy record --nonblocking --threads --idle -r 100 -d 60 -f raw -o $OUT/server.txt -p $SP > $OUT/spy.log 2>&1 &
/tmp/pyspy/py_spy-0.4.3.data/scripts/py-spy record --nonblocking --threads --idle -r 100 -d 60 -f raw -o $OUT/client.txt -p $BP > $OUT/spyc.log 2>&1 &
wait $BP
kill $SP; wait $SP
echo SPYDONE
