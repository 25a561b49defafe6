#!/usr/bin/env bash
# Session 40 (AMD Zen 4, AVX-512 BF16): a sustained pair against vLLM 0.32 bf16 at the new default
# (`auto`, band 0.08,0.12, close 128; no flags). sluice from the snapshot worktree /work/wt-s40.
# The third pair at the new default. /load is polled every 10 s while sluice runs.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s40-sustained-default-r3
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s40 $PY -m sluice.cli serve"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s40/default-r3-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-default-0.08-0.12 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
echo SUSTAINEDDONE $(date)
