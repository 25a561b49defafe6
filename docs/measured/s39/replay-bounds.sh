#!/usr/bin/env bash
# Session 39 (AMD Zen 4): throughput against TTFT at fixed bounds on workflows in flight, at the
# close-128 default, on the virtual clock (no controller ramp: the line the `auto` band moves
# along). 128 workflows at c=32 admitted by /load, actual history, 6 ngram drafts, seeds 0-1.
set -u
cd /work/main
out=docs/measured/s39/replay-bands
mkdir -p $out
run() {  # label seed args...
  local label=$1 seed=$2; shift 2
  .venv/bin/python benchmarks/engine_replay.py --virtual-clock --threads 1 --workflows 128 --concurrency 32 \
    --admission load --history actual --seed $seed \
    --speculative-config '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 2}' \
    --calls-out $out/$label-s$seed.calls.jsonl "$@" > $out/$label-s$seed.txt 2>&1
}
run bound09 0 --max-active-workflows 9 &
run bound12 0 --max-active-workflows 12 &
wait
run bound15 0 --max-active-workflows 15 &
run bound09 1 --max-active-workflows 9 &
wait
run bound12 1 --max-active-workflows 12 &
run bound15 1 --max-active-workflows 15 &
wait
echo BOUNDSDONE $(date)
