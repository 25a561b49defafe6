#!/usr/bin/env bash
# Session 46 (Intel with AMX): sluice alone, sustained c=32 (--history actual, /load admission) at
# bound 16, 180 s windows: prompt lookup with a fixed draft length (6, the default; 16) against a
# per-request adaptive one (EXPERIMENT: SLUICE_ADAPT_K=1, from 6, +2 after a verification that took
# every draft, -1 after one that did not, at most 16; at most 6 in steps that carry prompt tokens).
# Fixed runs from /work/wt-s46 (main's HEAD), the adaptive one from /work/main's working tree.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s46-adapt${TAG:-}
mkdir -p $OUT
run() { # label tree env k
  env PYTHONSAFEPATH=1 PYTHONPATH=$2 $3 $PY -m sluice.cli serve --port 8002 --max-active-workflows 16 \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $4}" > $OUT/serve-$1.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-$1 > $OUT/bench-$1.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-$1.txt
  kill $SP; wait $SP
  echo "$1 done $(date -u +%T)"; grep -iE "aggregate|ttft p|generation" $OUT/bench-$1.txt | head -5
  grep -E "^sluice:spec_decode_num_(draft_tokens|accepted_tokens|drafts)_total" $OUT/metrics-$1.txt
}
for R in ${RUNS:-k6-1 adapt-1 k16-1 adapt-2 k6-2}; do
  case $R in
    k6*) run $R /work/wt-s46 "SLUICE_ADAPT_K=0" 6 ;;
    k16*) run $R /work/wt-s46 "SLUICE_ADAPT_K=0" 16 ;;
    adapt*) run $R /work/main "SLUICE_ADAPT_K=1" 16 ;;
  esac
done
echo ADAPTDONE
