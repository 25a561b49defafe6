#!/usr/bin/env bash
# Session 49 (Intel with AMX, as s45): sluice alone, sustained c=32 (--history actual, /load admission) at
# fixed workflow bounds and the default auto, 180 s windows, with step traces: how throughput and
# TTFT depend on the number of workflows in flight on this host, and the steps to fit a cost model
# for the virtual-clock replay. sluice from /work/wt-s49 (a snapshot of main at 6ae5651).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s49-bounds${TAG:-}
mkdir -p $OUT
for N in ${BOUNDS:-12 16 20 24 auto}; do
  rm -f $OUT/trace-n$N.jsonl
  env PYTHONSAFEPATH=1 PYTHONPATH=${WT:-/work/wt-s49} $PY -m sluice.cli serve --port 8002 --max-active-workflows $N \
    --step-trace $OUT/trace-n$N.jsonl > $OUT/serve-n$N.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-n$N > $OUT/bench-n$N.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-n$N.txt
  kill $SP; wait $SP
  echo "n=$N done $(date -u +%T)"; grep -iE "aggregate|ttft|generation" $OUT/bench-n$N.txt | head -8
done
echo COLLECTDONE
