#!/usr/bin/env bash
# Session 46 (Intel with AMX): the burst test against vLLM 0.32 bf16 (session 35's command: 48
# workflows, c=32, --history actual), two more interleaved pairs after session 44's one, for the
# spread issue 5 asks for; sluice from /work/wt-s46 (a snapshot of main, default settings).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s46-burst
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s46 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario burst --quiet --history actual --workflows 48 --concurrency 32 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-s46 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 2 --out $OUT
cp $OUT/compare.md docs/measured/s46/burst-vs-vllm.md
echo BURSTDONE $(date -u +%T)
