#!/usr/bin/env bash
# Session 36: decodes yielding more to prompts, with the default `auto` bound (engine replay,
# 64 workflows, c=32, admission by the engine's `accepting`), alternated, 3 rounds.
set -u
cd /work/main
for round in 1 2 3; do
  for y in 1 1000; do
    echo "== round $round yield $y"
    env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s36 .venv/bin/python benchmarks/engine_replay.py \
      --workflows 64 --concurrency 32 --admission load --decode-yield-steps $y 2>&1 | grep -v "^\s*$" | tail -6
  done
done
