#!/usr/bin/env bash
# Session 56 (AMD EPYC Zen 4, family 25 model 17): no loss on the default path from the session's
# changes (a stream-interval check and one clock reading per step, a step time per output; the
# parsers are off by default): the sustained workload (admission by /load, as the vLLM pairs run
# it, every default), 180 s windows, two counterbalanced pairs (A B, B A), the session's start
# 99d3ab1 (/work/wt-s56-base) against 761096b (/work/wt-s56).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
A="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s56 $PY -m sluice.cli serve"
B="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s56-base $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --admission load --quiet --history actual \
  --a http://127.0.0.1:8000/v1 --a-label sluice-761096b --a-cmd "$A --port 8000" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-99d3ab1 --b-cmd "$B --port 8001" \
  --window 180 --concurrency 32 --repeats 2 --out bench-results/s56-ab-default-path
cp bench-results/s56-ab-default-path/compare.md docs/measured/s56/ab-default-path.md
echo ABDONE $(date -u +%T)
