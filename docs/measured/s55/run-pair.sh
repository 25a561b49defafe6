#!/usr/bin/env bash
# Session 55 (AMD EPYC Zen 4, family 25 model 17, as s52-54): a sustained pair against vLLM 0.32 bf16 (sessions 39-50's
# command: 600 s, c=32, --history actual, sluice admitting by /load, vLLM on the closed loop), sluice with
# its defaults (the auto bound with s50's step-ratio cap; `--weight-format auto`, bf16 on this vector path), from /work/wt-s55.
# At 7fc8d53 (this session: vLLM request fields, the Messages API; nothing on the default path but a flag check per sampling row and one tuple element in the policy key): to show no loss and add a Zen 4 sample.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s55-sustained${TAG:-}
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s55 $PY -m sluice.cli serve"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s55/pair${TAG:-}-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-s55-auto --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT/pair
echo PAIRDONE $(date -u +%T)
