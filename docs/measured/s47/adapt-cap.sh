#!/usr/bin/env bash
# Session 47 (Intel with AMX): sluice alone, sustained c=32 (--history actual, /load admission) at
# bound 16, 180 s windows: the adaptive draft length's cap (num_speculative_tokens) 16 (the
# default) against 24 and 32. All from /work/wt-s47 (main's HEAD, 077242d, with config.py's cap on
# num_speculative_tokens raised from 16 to 64).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s47-cap${TAG:-}
mkdir -p $OUT
run() { # label k
  env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s47 $PY -m sluice.cli serve --port 8002 --max-active-workflows 16 \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $2}" > $OUT/serve-$1.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-$1 > $OUT/bench-$1.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-$1.txt
  kill $SP; wait $SP
  echo "$1 done $(date -u +%T)"
}
for R in ${RUNS:-c16-1 c32-1 c24-1 c16-2 c32-2}; do
  run $R ${R:1:2}
done
echo CAPDONE
