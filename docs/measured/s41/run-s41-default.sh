#!/usr/bin/env bash
# Session 41 (AMD Zen 4, AVX-512 BF16): sustained pairs against vLLM 0.32 bf16 at the default
# (`auto`, band 0.08,0.12; no flags) with the fixed cost from the kept small-step fit (r1: ee177b5, scaled on all steps;
# r2: 9b55929, scaled on the steps within the kept fit's reach; r3 on: d99d2be, a fit kept only from a
# whole window, the bound held at its start until then).
# sluice from the snapshot worktree /work/wt-s41. /load is polled every 10 s while sluice runs;
# sluice's server log (the "workflow bound" lines) is kept. Usage: run-s41-default.sh TAG
set -u
TAG=${1:-r1}
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s41-sustained-default-$TAG
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s41 $PY -m sluice.cli serve"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s41/default-$TAG-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-default-s41 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
echo SUSTAINEDDONE $(date)
