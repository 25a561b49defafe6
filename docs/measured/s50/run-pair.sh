#!/usr/bin/env bash
# Session 50 (Intel with AMX, family 6 model 167): a sustained pair against vLLM 0.32 bf16 (sessions 39-49's
# command: 600 s, c=32, --history actual, sluice admitting by /load, vLLM on the closed loop), sluice with
# its defaults (the auto bound, now capped by --auto-step-ratio 0.8,1.0), from /work/wt-s50.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s50-sustained${TAG:-}
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s50 $PY -m sluice.cli serve"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s50/pair${TAG:-}-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-s50-auto --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT/pair
echo PAIRDONE $(date -u +%T)
