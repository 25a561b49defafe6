#!/usr/bin/env bash
# Session 49 (Intel with AMX): issue 4's pressure setting (24,064 tokens of KV, sluice `workflow`
# with its default auto bound admitting by /load, c=32, WIN s windows, 300 here), sluice alone,
# `--weight-format native` against `bf16`, BA AB order (bf16 first), one build (/work/wt-s49 at
# ab878c9): whether keeping the GGUF's blocks changes anything under pressure (the pressure run
# at native read 501.3 tok/s, at the low end of sessions 44-48's 503-555).
set -u
cd /work/main
BASE=/work/wt-s49
OUT=bench-results/s49-ab-pressure
mkdir -p $OUT
WIN=${WIN:-300}
wait_up() { for i in $(seq 1 400); do curl -sf "$1/models" >/dev/null && return 0; sleep 1; done; return 1; }
run() { # label format
  (cd $BASE && PYTHONSAFEPATH=1 PYTHONPATH=$BASE exec /work/main/.venv/bin/python -m sluice.cli serve --port 8001 --kv-cache-tokens 24064 --scheduling-policy workflow --weight-format $2) > $OUT/$1-server.log 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8001/v1 || { echo "server $1 did not start"; kill $pid; return; }
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8001/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/$1 > $OUT/$1.log 2>&1
  curl -s http://127.0.0.1:8001/metrics > $OUT/$1-metrics.txt
  kill $pid; wait $pid 2>/dev/null
  echo "$(date -u +%T) done $1: $(grep -E 'Aggregate' $OUT/$1/summary.md) $(grep -E 'TTFT p50' $OUT/$1/summary.md)"
}
run bf16-1 bf16
run native-1 native
run native-2 native
run bf16-2 bf16
echo ABDONE
