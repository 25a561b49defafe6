#!/usr/bin/env bash
# Session 41 (AMD Zen 4): a sustained pair against vLLM 0.32 bf16 with `--auto-overhead-band 0.06,0.09`
# at d99d2be (the fixed cost from a kept whole-window fit of small steps). With that estimator the
# default band 0.08,0.12 settled at 10-11 workflows; the fixed-bound sweep and s40's fixed-12 pair
# put both sustained targets at 12-16, which this band should reach. sluice from /work/wt-s41.
set -u
TAG=${1:-band006}
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s41-sustained-$TAG
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s41 $PY -m sluice.cli serve --auto-overhead-band 0.06,0.09"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s41/$TAG-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-band-0.06-0.09 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
echo SUSTAINEDDONE $(date)
