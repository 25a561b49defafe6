#!/usr/bin/env bash
# Session 52 (AMD EPYC Zen 4, vector path): as ab-format.sh (sluice alone, sustained c=32, 180 s, ABBA
# bf16 / native), with the bound fixed at 12 (the auto bound confounded ab-format.sh: its fixed-cost
# fit read 3.8 ms in one run, 9 ms in the others), at main's 1a3b1e2 (/work/wt-s52-base): ab-format-b12.sh
# ran native with a whole-weight dequantization of prefill-sized calls that turned out slower
# (gemm-whole-ab.txt) and was dropped.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s52-ab-format-b12-base${TAG:-}
mkdir -p $OUT
env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s52-base $PY -m sluice.attention.cpu.build
run() { # label format
  env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s52-base $PY -m sluice.cli serve --port 8002 --max-active-workflows 12 \
    --weight-format $2 > $OUT/serve-$1.log 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
  .venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
    --window ${WIN:-180} --concurrency 32 --repeats 1 --out $OUT/bench-$1 > $OUT/bench-$1.txt 2>&1
  curl -s http://127.0.0.1:8002/metrics > $OUT/metrics-$1.txt
  grep "VmHWM\|VmRSS" /proc/$SP/status > $OUT/rss-$1.txt 2>/dev/null
  kill $SP; wait $SP
  echo "$1 done $(date -u +%T)"; grep -iE "aggregate|ttft p50|generation" $OUT/bench-$1.txt | head -3
}
run bf16-1 bf16
run native-1 native
run native-2 native
run bf16-2 bf16
echo ABDONE
