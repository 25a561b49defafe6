#!/usr/bin/env bash
# Session 53 (Zen 4 again, at 44bd599: the kept step-cost fit chosen by median among the latest small windows): session 52's pressure600.sh repeated unchanged but for the tree.
# Session 52: the `workflow` and `fcfs` runs of pressure.sh again with sessions 35-43's 600 s windows (WIN=600, no vLLM run):
# at 300 s `fcfs` had not reached the pressure's steady state (its 160.9 tok/s against 133-138 in 600 s runs).
# Issue 4 under pressure session 52 (AMD EPYC Zen 4, family 25 model 17; the defaults: auto bound, `--weight-format auto` = bf16 here): as sessions 35-43 and 44-49, after session 35's
# docs/measured/s35/pressure.sh, which followed docs/measured/s34/pressure-auto.sh (WIN s windows, 300 here; c=32, 24,064 tokens of KV for all three
# engines, sluice `workflow` (default auto bound) admitting by /load, `fcfs` and vLLM on the plain
# closed loop), in the order workflow, fcfs, vLLM (WIN=300 in this session, as on the AMX host; sessions 35-43 ran 600); vLLM in bfloat16 (VDTYPE), its best dtype here.
# During the workflow run, /load is polled every 10 s.
set -u
cd /work/main
BASE=${BASE:-/work/wt-s53}
OUT=bench-results/s53-pressure600-$(git -C $BASE rev-parse --short HEAD)
mkdir -p $OUT
WIN=${WIN:-600}
wait_up() { for i in $(seq 1 400); do curl -sf "$1/models" >/dev/null && return 0; sleep 1; done; return 1; }
run_sluice() { # label policy admission
  (cd $BASE && PYTHONSAFEPATH=1 PYTHONPATH=$BASE exec /work/main/.venv/bin/python -m sluice.cli serve --port 8001 --kv-cache-tokens 24064 --scheduling-policy $2) > $OUT/$1-server.log 2>&1 &
  local pid=$!
  wait_up http://127.0.0.1:8001/v1 || { echo "server $1 did not start"; kill $pid; return; }
  echo "$(date -u +%T) start $1"
  ( while kill -0 $pid 2>/dev/null; do echo "$(date -u +%T) $(curl -s http://127.0.0.1:8001/load)"; sleep 10; done ) > $OUT/$1-load-poll.txt 2>&1 &
  local poll=$!
  .venv/bin/sluice bench sustained --quiet --history actual --admission $3 --base-url http://127.0.0.1:8001/v1 --window $WIN --concurrency 32 --repeats 1 --out $OUT/$1 > $OUT/$1.log 2>&1
  curl -s http://127.0.0.1:8001/metrics > $OUT/$1-metrics.txt
  kill $poll 2>/dev/null
  kill $pid; wait $pid 2>/dev/null
  echo "$(date -u +%T) done $1"
}
run_sluice workflow workflow load
run_sluice fcfs fcfs closed
echo ALLDONE
