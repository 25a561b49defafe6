#!/usr/bin/env bash
# Session 50 (Intel with AMX): issue 4's pressure setting (24,064 tokens of KV, sluice `workflow`
# with its default auto bound admitting by /load, c=32, 300 s windows), sluice alone, the auto
# bound with the step-ratio cap (the new default) against `--auto-step-ratio none`, in the order
# capfar, none; /work/wt-s50 with the far-jump rule (a quarter more at once while the step ratio is
# under 0.75 of the cap's low end): whether the capped bound's slower climb was the ~4% it cost.
set -u
cd /work/main
BASE=/work/wt-s50
OUT=bench-results/s50-ab-pressure
mkdir -p $OUT
WIN=${WIN:-300}
wait_up() { for i in $(seq 1 400); do curl -sf "$1/models" >/dev/null && return 0; sleep 1; done; return 1; }
run() { # label, extra flags
  local L=$1; shift
  (cd $BASE && PYTHONSAFEPATH=1 PYTHONPATH=$BASE exec /work/main/.venv/bin/python -m sluice.cli serve --port 8001 --kv-cache-tokens 24064 --scheduling-policy workflow "$@") > $OUT/$L-server.log 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8001/v1 || { echo "server $L did not start"; kill $pid; return; }
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8001/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/$L > $OUT/$L.log 2>&1
  curl -s http://127.0.0.1:8001/metrics > $OUT/$L-metrics.txt
  kill $pid; wait $pid 2>/dev/null
  echo "$(date -u +%T) done $L: $(grep -E 'Aggregate' $OUT/$L/summary.md) $(grep -E 'TTFT p50' $OUT/$L/summary.md) $(grep -E 'TTFT p90' $OUT/$L/summary.md) $(grep -E '^sluice:(max_active_workflows|engine_step_ratio)' $OUT/$L-metrics.txt | sed 's/{[^}]*}//' | tr '\n' ' ')"
}
run capfar-1
run none-3 --auto-step-ratio none
echo ABDONE
