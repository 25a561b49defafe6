#!/usr/bin/env bash
# Session 51 (Intel with AMX, as s44-50): sluice alone, sustained c=32 (--history actual, /load
# admission), 180 s windows, one server per run: the auto bound with the step-ratio cap (the new
# default), without it (`--auto-step-ratio none`, the s42-s49 controller) and a fixed bound of 16.
# sluice from /work/wt-s51 (a snapshot of the working tree). Logs the bound's moves.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s51-yield${TAG:-}
mkdir -p $OUT
run() {  # name, server flags...
  local NAME=$1; shift
  env PYTHONSAFEPATH=1 PYTHONPATH=${WT:-/work/wt-s51} $PY -m sluice.cli serve --port 8002 "$@" \
    > $OUT/serve-$NAME.log 2>&1 &
  local SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-$NAME > $OUT/bench-$NAME.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-$NAME.txt
  kill $SP; wait $SP
  echo "== $NAME $(date -u +%T) $(grep -E '^sluice:(max_active_workflows|engine_overhead|engine_step_ratio)' $OUT/metrics-$NAME.txt | sed 's/{[^}]*}//' | tr '\n' ' ')"
  grep -E "Aggregate output|TTFT p50|TTFT p90|generation speed \(median" $OUT/bench-$NAME.txt | tr -s ' ' | tr '\n' ' '; echo
}
for R in ${RUNS:-y1 y3 y3b y1b}; do
  N=${R#y}; N=${N%b}
  run $R --decode-yield-steps $N
done
echo ABDONE
