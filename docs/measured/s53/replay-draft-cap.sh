#!/usr/bin/env bash
# Session 53 (Zen 4): the adaptive draft length's cap (num_speculative_tokens, default 16 since session 46,
# chosen on the AMX host) against 10, in the engine replay at the sustained operating point (64 workflows,
# c=32, /load admission, bound 12, --history actual), ABBA.
set -u
cd /work/main
run() { # label cap
  .venv/bin/python benchmarks/engine_replay.py --workflows 64 --concurrency 32 --admission load --max-active-workflows 12 \
    --history actual --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $2}" > docs/measured/s53/replay-cap-$1.txt 2>&1
  echo "$1: $(grep -E '^wall|^while fed|^speculation' docs/measured/s53/replay-cap-$1.txt | tr '\n' ' ')"
}
run ${A:-16}-r${R1:-1} ${A:-16}
run ${B:-10}-r${R1:-1} ${B:-10}
run ${B:-10}-r${R2:-2} ${B:-10}
run ${A:-16}-r${R2:-2} ${A:-16}
