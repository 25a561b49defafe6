#!/usr/bin/env bash
# Session 51 (Intel with AMX): sluice alone, sustained c=32 (--history actual, /load admission),
# 180 s windows, one server per run, defaults only: the session's start (/work/wt-s51, 548784b's
# engine) against the AVX-512 attention kernel's prefetch planned as byte ranges (/work/wt-pf, a
# snapshot of the working tree with the change), ABBA.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s51-prefetch
mkdir -p $OUT
run() {  # name, worktree
  local NAME=$1 WT=$2
  env PYTHONSAFEPATH=1 PYTHONPATH=$WT $PY -m sluice.cli serve --port 8002 > $OUT/serve-$NAME.log 2>&1 &
  local SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-$NAME > $OUT/bench-$NAME.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-$NAME.txt
  kill $SP; wait $SP
  echo "== $NAME $(date -u +%T) $(grep -E '^sluice:(max_active_workflows|engine_overhead|engine_step_ratio)' $OUT/metrics-$NAME.txt | sed 's/{[^}]*}//' | tr '\n' ' ')"
  grep -E "Aggregate output|TTFT p50|TTFT p90|generation speed \(median|Call latency p50" $OUT/bench-$NAME.txt | tr -s ' ' | tr '\n' ' '; echo
}
run base1 /work/wt-s51
run new1 /work/wt-pf
run new2 /work/wt-pf
run base2 /work/wt-s51
echo ABDONE
