#!/usr/bin/env bash
# Session 36 (AMD Zen 4, AVX-512 BF16): without pressure, workflow vs fcfs (session 29's pairs:
# default KV, both on the plain closed loop, 180 s windows, 2 interleaved pairs); then a second
# 600 s sustained pair against vLLM 0.32 bf16 with the default `auto` bound. sluice from the
# snapshot worktree /work/wt-s36 (81c9a4d).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s36 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --quiet --history actual \
  --a http://127.0.0.1:8000/v1 --a-label sluice-workflow --a-cmd "$SL --port 8000 --scheduling-policy workflow" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-fcfs --b-cmd "$SL --port 8001 --scheduling-policy fcfs" \
  --window 180 --concurrency 32 --repeats 2 --out bench-results/s36-plenty-workflow-vs-fcfs
echo PLENTYDONE $(date)
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out bench-results/s36-sustained
echo SUSTAINEDDONE $(date)
