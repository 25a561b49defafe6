#!/usr/bin/env bash
# Session 53 (AMD EPYC Zen 4): session 35's burst pair repeated at the current code (48 workflows, c=32,
# --history actual, 3 interleaved repeats, sluice with every default, vLLM 0.32 bf16 at 2 threads), from /work/wt-s53b.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s53b $PY -m sluice.attention.cpu.build
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s53b $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario burst --quiet --history actual --workflows 48 --concurrency 32 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-s53 --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 3 --out bench-results/s53-burst
echo BURSTDONE $(date -u +%T)
