#!/usr/bin/env bash
# Issue 4 pressure, third run of session 29, workflow and vLLM only (the 3x-vLLM target was at the
# edge after two runs): as pressure-long-repeat2.sh, order W V, sluice from this tree (code = 7727ad9).
set -u
cd /work/main
OUT=bench-results/pressure-long-$(git rev-parse --short HEAD)-r3
mkdir -p $OUT
WIN=${WIN:-600}
wait_up() { for i in $(seq 1 400); do curl -sf "$1/models" >/dev/null && return 0; sleep 1; done; return 1; }
.venv/bin/python -m sluice.cli serve --port 8001 --kv-cache-tokens 24064 --scheduling-policy workflow > $OUT/workflow-server.log 2>&1 &
pid=$!
if wait_up http://127.0.0.1:8001/v1; then
  echo "$(date -u +%T) start workflow"
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8001/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/workflow > $OUT/workflow.log 2>&1
  curl -s http://127.0.0.1:8001/metrics > $OUT/workflow-metrics.txt
  echo "$(date -u +%T) done workflow"
fi
kill $pid; wait $pid 2>/dev/null
env DTYPE=float32 NUM_BLOCKS=188 scripts/serve-vllm.sh > $OUT/vllm-server.log 2>&1 &
VP=$!
if wait_up http://127.0.0.1:8100/v1; then
  echo "$(date -u +%T) start vllm"
  .venv/bin/sluice bench sustained --quiet --history actual --admission closed --base-url http://127.0.0.1:8100/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/vllm > $OUT/vllm.log 2>&1
  echo "$(date -u +%T) done vllm"
fi
pkill -f "vllm serve" ; kill $VP 2>/dev/null; sleep 3; pkill -9 -f "vllm" 2>/dev/null
echo ALLDONE
