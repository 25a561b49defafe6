#!/bin/bash
# Session 46: the cap on drafts in steps with prompt tokens (6, committed, against 2), bound 16, 180 s, sluice alone
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s46-cap; mkdir -p $OUT
for R in cap6-1 cap2-1 cap2-2 cap6-2; do
  C=${R#cap}; C=${C%-*}
  env SLUICE_PROMPT_STEP_DRAFTS=$C PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s46c $PY -m sluice.cli serve --port 8002 --max-active-workflows 16 > $OUT/serve-$R.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window 180 --concurrency 32 --repeats 1 --out $OUT/bench-$R > $OUT/bench-$R.txt 2>&1
  kill $SP; wait $SP
  echo "$R $(grep -E 'Aggregate|TTFT p50|TTFT p90|TTFT p99|generation' $OUT/bench-$R.txt | awk -F'|' '{printf "%s", $3}')"
done
echo CAPDONE
