#!/usr/bin/env bash
# Session 45 (Intel with AMX): sluice alone, sustained c=32 (--history actual, /load admission) at a
# fixed bound (BOUND, default 16), 180 s windows, with prompt lookup drafting K tokens (KS): does a
# longer draft pay where verification rows are cheap (AMX)? /metrics dumped after each run.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s45-spec${TAG:-}
mkdir -p $OUT
B=${BOUND:-16}
for K in ${KS:-10 16}; do
  env PYTHONSAFEPATH=1 PYTHONPATH=${WT:-/work/wt-s45b} $PY -m sluice.cli serve --port 8002 --max-active-workflows $B \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $K}" > $OUT/serve-k$K.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-k$K > $OUT/bench-k$K.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-k$K.txt
  kill $SP; wait $SP
  echo "k=$K done $(date -u +%T)"; grep -iE "aggregate|ttft|generation" $OUT/bench-k$K.txt | head -5
  grep -E "^sluice:spec_decode_num_(draft_tokens|accepted_tokens|drafts)_total" $OUT/metrics-k$K.txt
done
echo SPECDONE
