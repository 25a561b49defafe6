#!/usr/bin/env bash
# Session 36: a 600 s sustained pair against vLLM with the auto bound's band between the default
# (0.10,0.15) and 0.06,0.10.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s36 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-band-0.08-0.12 --a-cmd "$SL --port 8000 --auto-overhead-band 0.08,0.12" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out bench-results/s36-sustained-band2
echo BAND2DONE $(date)
