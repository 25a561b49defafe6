#!/usr/bin/env bash
# Issue 4 pressure, second run of session 29: as docs/measured/s28/pressure-long-script-not-run.sh
# (600 s windows, c=32, 24,064 tokens of KV for all three) but in the order vLLM, fcfs, workflow,
# and sluice from a worktree at the first run's commit (BASE, default /tmp/wt-base at 7727ad9).
set -u
cd /work/main
BASE=${BASE:-/tmp/wt-base}
OUT=bench-results/pressure-long-$(git -C $BASE rev-parse --short HEAD)-r2
mkdir -p $OUT
WIN=${WIN:-600}
wait_up() { for i in $(seq 1 400); do curl -sf "$1/models" >/dev/null && return 0; sleep 1; done; return 1; }
env DTYPE=float32 NUM_BLOCKS=188 scripts/serve-vllm.sh > $OUT/vllm-server.log 2>&1 &
VP=$!
if wait_up http://127.0.0.1:8100/v1; then
  echo "$(date -u +%T) start vllm"
  .venv/bin/sluice bench sustained --quiet --history actual --admission closed --base-url http://127.0.0.1:8100/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/vllm > $OUT/vllm.log 2>&1
  echo "$(date -u +%T) done vllm"
fi
pkill -f "vllm serve" ; kill $VP 2>/dev/null; sleep 3; pkill -9 -f "vllm" 2>/dev/null; sleep 5
run_sluice() { # label policy admission
  (cd $BASE && PYTHONSAFEPATH=1 PYTHONPATH=$BASE exec /work/main/.venv/bin/python -m sluice.cli serve --port 8001 --kv-cache-tokens 24064 --scheduling-policy $2) > $OUT/$1-server.log 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8001/v1 || { echo "server $1 did not start"; kill $pid; return; }
  echo "$(date -u +%T) start $1"
  .venv/bin/sluice bench sustained --quiet --history actual --admission $3 --base-url http://127.0.0.1:8001/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/$1 > $OUT/$1.log 2>&1
  curl -s http://127.0.0.1:8001/metrics > $OUT/$1-metrics.txt
  kill $pid; wait $pid 2>/dev/null
  echo "$(date -u +%T) done $1"
}
run_sluice fcfs fcfs closed
run_sluice workflow workflow load
echo ALLDONE
