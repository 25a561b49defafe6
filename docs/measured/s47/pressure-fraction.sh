#!/usr/bin/env bash
# Session 47 (Intel with AMX): sluice `workflow` alone under pressure (24,064 tokens of KV, c=32,
# /load admission, default auto bound, 300 s windows), the KV headroom's reservation of each
# admitted workflow's growth to a typical final size scaled by SLUICE_FINAL_FRACTION (EXPERIMENT
# in /work/main's working tree; 1 = main's rule).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s47-fraction${TAG:-}
mkdir -p $OUT
WIN=${WIN:-300}
run() { # label fraction
  env PYTHONSAFEPATH=1 PYTHONPATH=/work/main SLUICE_FINAL_FRACTION=$2 $PY -m sluice.cli serve --port 8001 --kv-cache-tokens 24064 > $OUT/serve-$1.log 2>&1 &
  local pid=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8001/health >/dev/null && break; sleep 1; done
  ( while kill -0 $pid 2>/dev/null; do echo "$(date -u +%T) $(curl -s http://127.0.0.1:8001/load)"; sleep 10; done ) > $OUT/load-poll-$1.txt 2>&1 &
  local poll=$!
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8001/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/bench-$1 > $OUT/bench-$1.txt 2>&1
  curl -s http://127.0.0.1:8001/metrics > $OUT/metrics-$1.txt
  kill $poll 2>/dev/null
  kill $pid; wait $pid 2>/dev/null
  echo "$1 done $(date -u +%T)"
}
for R in ${RUNS:-f1.0-1 f0.6-1 f0.3-1}; do
  F=${R#f}; run $R ${F%-*}
done
echo FRACDONE
