#!/usr/bin/env bash
# Session 40 (AMD Zen 4, AVX-512 BF16): a sustained pair against vLLM 0.32 bf16 with the bound
# fixed at 12 (`--max-active-workflows 12`), where the default band settled in 3 of 5 pairs: what a
# controller that does not wander would give. sluice from the snapshot worktree /work/wt-s40 (9438bc8).
# /load is polled every 10 s while sluice runs.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s40-sustained-fixed12
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s40 $PY -m sluice.cli serve --max-active-workflows 12"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s40/fixed12-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-fixed-12 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
echo SUSTAINEDDONE $(date)
