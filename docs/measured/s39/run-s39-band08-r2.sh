#!/usr/bin/env bash
# Session 39 (AMD Zen 4, AVX-512 BF16): a sustained pair against vLLM 0.32 bf16 as
# run-s39-close128.sh (the default close_step_tokens 128), with the `auto` bound steered by a lower
# overhead band between the default and 0.06,0.10 (which ran to the maximum bound at close 128).
# sluice from the snapshot worktree /work/wt-s39 (6409dfa, the engine of 0a688bb); the second pair at this band. /load is polled every 10 s while sluice runs.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s39-sustained-band08-r2
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s39 $PY -m sluice.cli serve --auto-overhead-band 0.08,0.12"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s39/band08-r2-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-band-0.08-0.12 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
echo SUSTAINEDDONE $(date)
