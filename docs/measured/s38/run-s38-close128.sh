#!/usr/bin/env bash
# Session 38 (AMD Zen 4, AVX-512 BF16): a sustained pair against vLLM 0.32 bf16 with
# the default `auto` bound (sessions 35-37's command), with close_step_tokens 128 (the new default) and the shortest-remaining-prompt
# tie-break. sluice from the snapshot worktree
# /work/wt-s38b (2bb458c: close_step_tokens 128).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s38b $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out bench-results/s38-sustained-close128
echo SUSTAINEDDONE $(date)
