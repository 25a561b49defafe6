#!/usr/bin/env bash
# Session 41 (AMD Zen 4): step traces of sluice at fixed workflow bounds, to see how a step's cost
# depends on its shape across the range the auto bound visits (the s40 finding: the linear fit's
# intercept rises with the bound). 150 s sustained window at c=32 per bound; sluice from main.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s41-traces
mkdir -p $OUT
for N in 4 8 12 16 24; do
  rm -f $OUT/trace-n$N.jsonl
  $PY -m sluice.cli serve --port 8002 --max-active-workflows $N --step-trace $OUT/trace-n$N.jsonl > $OUT/serve-n$N.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window 150 --concurrency 32 --repeats 1 --out $OUT/bench-n$N > $OUT/bench-n$N.txt 2>&1
  kill $SP; wait $SP
  echo "n=$N done $(date -u +%T)"
done
echo COLLECTDONE
