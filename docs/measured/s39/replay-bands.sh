#!/usr/bin/env bash
# Session 39 (AMD Zen 4): the overhead band of the `auto` bound at the close-128 default, on the
# virtual clock (deterministic, two runs side by side at one thread each). 128 workflows at c=32
# admitted by /load, actual history, ngram speculation as `sluice serve` (6 drafts), seeds 0-1.
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
for seed in 0 1; do
  run band10-15 $seed --max-active-workflows auto &
  run band08-12 $seed --max-active-workflows auto --auto-overhead-band 0.08,0.12 &
  wait
  run band06-10 $seed --max-active-workflows auto --auto-overhead-band 0.06,0.10 &
  run nobound $seed --max-active-workflows none &
  wait
done
echo BANDSDONE $(date)
