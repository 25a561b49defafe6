#!/usr/bin/env bash
# Session 48 (Intel with AMX): sluice alone, sustained c=32 (--history actual, /load admission) at
# bound 16, 180 s windows: the session's start (8d5c375, /work/wt-s48-base) against its kernels
# (3bc744d, /work/wt-s48: vector linears split by passes, AMX attention's V rearranged during the
# scores), ABBA, after the pair's slower-than-usual sluice run. Each tree's extension built first.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s48-ab${TAG:-}
mkdir -p $OUT
for T in wt-s48-base wt-s48; do env PYTHONSAFEPATH=1 PYTHONPATH=/work/$T $PY -m sluice.attention.cpu.build; done
run() { # label tree
  env PYTHONSAFEPATH=1 PYTHONPATH=/work/$2 $PY -m sluice.cli serve --port 8002 --max-active-workflows 16 > $OUT/serve-$1.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-$1 > $OUT/bench-$1.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-$1.txt
  kill $SP; wait $SP
  echo "$1 done $(date -u +%T)"
}
run base-1 wt-s48-base
run head-1 wt-s48
run head-2 wt-s48
run base-2 wt-s48-base
echo ABDONE
