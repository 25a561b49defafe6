#!/usr/bin/env bash
# Session 39 (AMD Zen 4, AVX-512 BF16): a sustained pair against vLLM 0.32 bf16 with
# the default `auto` bound (sessions 35-37's command), with close_step_tokens 128 (the new default) and the shortest-remaining-prompt
# tie-break. sluice from the snapshot worktree
# /work/wt-s39 (0a688bb: close_step_tokens 128, as 2bb458c for the engine).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s39 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out bench-results/s39-sustained-close128-r2
echo SUSTAINEDDONE $(date)
