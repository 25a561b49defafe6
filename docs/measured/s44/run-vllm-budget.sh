#!/usr/bin/env bash
# Session 44 (Intel with AMX, family 6 model 167): a sustained pair against vLLM 0.32 bf16 (sessions 39-42's command: 600 s,
# c=32, --history actual, sluice's default auto bound admitting by /load, vLLM on the closed loop)
# with the linears and attention on AMX tiles and a step token budget of $BUDGET (default 512). sluice from /work/wt-s44 (a snapshot of main).
set -u
TAG=${1:-r1}
BUDGET=${BUDGET:-1024}
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s44-sustained-$TAG
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s44 $PY -m sluice.cli serve"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s44/$TAG-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-s44-budget$BUDGET --a-cmd "$SL --port 8000 --max-num-batched-tokens $BUDGET" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
grep "workflow bound" $OUT/a.server.log > docs/measured/s44/$TAG-bound-log.txt
echo SUSTAINEDDONE $(date)
