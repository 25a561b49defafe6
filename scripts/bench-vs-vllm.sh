#!/usr/bin/env bash
# The measured comparisons of docs/benchmarks.md: sluice vs vLLM 0.32 (CPU), one engine at a time
# (compare's default order: pairs A B, B A, ..., a fresh server for every run).
#
#   scripts/bench-vs-vllm.sh [plenty|pressure|single|all]   (default all)
#
# plenty:   both engines with a 1 GiB KV cache (the working set fits): burst and sustained.
# pressure: both with 24,064 tokens of KV (vLLM: 188 blocks of 128), smaller than the working set
#           of 32 concurrent workflows; sustained: sluice `workflow` vs vLLM, then sluice `fcfs`
#           alone (the plain closed loop).
# Sustained runs admit new workflows by `GET /load` (--admission load) where the server has it:
# sluice does, vLLM does not, so its side runs the plain closed loop (the tables since session 6).
# single:   one workflow at a time (concurrency 1, 4 workflows): what a user of one agent sees.
# sluice serves with prompt-lookup speculative decoding unless told `--speculative-config none`.
# spec:     prompt-lookup speculative decoding (SPEC below) on both engines, with and without:
#           burst sluice+spec vs vLLM, burst sluice vs vLLM+spec, sustained sluice+spec vs vLLM,
#           and single user for all four.
# Results go to bench-results/<name>/ (results.json, summary.md, compare.md, plots).
# HISTORY=actual (the default, as in the tables since session 8) appends each engine's own reply
# to the next call's conversation, as an agent client does; HISTORY=synthetic appends drawn text
# of the same length, so both engines get identical bodies (the tables before session 8).
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT="${1:-all}"
mkdir -p "${OUT:-bench-results}"
SLUICE=".venv/bin/sluice"
OUT="${OUT:-bench-results}"
CONC="${CONC:-32}"
REPEATS="${REPEATS:-3}"
BURST_WORKFLOWS="${BURST_WORKFLOWS:-48}"
WINDOW="${WINDOW:-75}"
HISTORY="${HISTORY:-actual}"
SPEC='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
A="http://127.0.0.1:8000/v1"
B="http://127.0.0.1:8100/v1"

if [ "$WHAT" = plenty ] || [ "$WHAT" = all ]; then
    "$SLUICE" bench compare --scenario burst --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice --a-cmd "$SLUICE serve --port 8000" \
        --b "$B" --b-label vllm-0.32 --b-cmd "scripts/serve-vllm.sh" \
        --workflows "$BURST_WORKFLOWS" --concurrency "$CONC" --repeats "$REPEATS" \
        --manifest "$OUT/burst-manifest.jsonl" --out "$OUT/burst"
    "$SLUICE" bench compare --scenario sustained --quiet --history "$HISTORY" --admission load \
        --a "$A" --a-label sluice --a-cmd "$SLUICE serve --port 8000" \
        --b "$B" --b-label vllm-0.32 --b-cmd "scripts/serve-vllm.sh" \
        --window "$WINDOW" --concurrency "$CONC" --repeats "$REPEATS" --out "$OUT/sustained"
fi

if [ "$WHAT" = pressure ] || [ "$WHAT" = all ]; then
    PREPEATS="${PRESSURE_REPEATS:-1}"
    "$SLUICE" bench compare --scenario sustained --quiet --history "$HISTORY" --admission load \
        --a "$A" --a-label sluice-workflow --a-cmd "$SLUICE serve --port 8000 --kv-cache-tokens 24064 --scheduling-policy workflow" \
        --b "$B" --b-label vllm-0.32-188blocks --b-cmd "env NUM_BLOCKS=188 scripts/serve-vllm.sh" \
        --window "$WINDOW" --concurrency "$CONC" --repeats "$PREPEATS" --out "$OUT/pressure-vllm"
    bash -c "exec $SLUICE serve --port 8001 --kv-cache-tokens 24064 --scheduling-policy fcfs" > "$OUT/pressure-fcfs-server.log" 2>&1 &
    SERVER=$!
    trap 'kill $SERVER 2>/dev/null || true' EXIT
    until curl -sf http://127.0.0.1:8001/health > /dev/null; do sleep 1; done
    "$SLUICE" bench sustained --quiet --history "$HISTORY" --base-url "http://127.0.0.1:8001/v1" \
        --window "$WINDOW" --concurrency "$CONC" --repeats "$PREPEATS" --out "$OUT/pressure-fcfs"
    kill -TERM "$SERVER"; wait "$SERVER" || true
fi

if [ "$WHAT" = single ] || [ "$WHAT" = all ]; then
    "$SLUICE" bench compare --scenario burst --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice --a-cmd "$SLUICE serve --port 8000" \
        --b "$B" --b-label vllm-0.32 --b-cmd "scripts/serve-vllm.sh" \
        --workflows 4 --concurrency 1 --repeats 1 --out "$OUT/single"
fi

if [ "$WHAT" = spec ]; then
    SSPEC="$SLUICE serve --port 8000 --speculative-config '$SPEC'"
    VSPEC="scripts/serve-vllm.sh --speculative-config '$SPEC'"
    "$SLUICE" bench compare --scenario burst --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice-spec --a-cmd "$SSPEC" \
        --b "$B" --b-label vllm-0.32 --b-cmd "scripts/serve-vllm.sh" \
        --workflows "$BURST_WORKFLOWS" --concurrency "$CONC" --repeats "$REPEATS" --out "$OUT/burst-spec" || echo "burst-spec failed"
    "$SLUICE" bench compare --scenario burst --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice-plain --a-cmd "$SLUICE serve --port 8000 --speculative-config none" \
        --b "$B" --b-label vllm-0.32-spec --b-cmd "$VSPEC" \
        --workflows "$BURST_WORKFLOWS" --concurrency "$CONC" --repeats "$REPEATS" --out "$OUT/burst-vllm-spec" || echo "burst-vllm-spec failed"
    "$SLUICE" bench compare --scenario sustained --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice-spec --a-cmd "$SSPEC" \
        --b "$B" --b-label vllm-0.32 --b-cmd "scripts/serve-vllm.sh" --admission load \
        --window "$WINDOW" --concurrency "$CONC" --repeats "$REPEATS" --out "$OUT/sustained-spec" || echo "sustained-spec failed"
    "$SLUICE" bench compare --scenario burst --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice-spec --a-cmd "$SSPEC" \
        --b "$B" --b-label vllm-0.32-spec --b-cmd "$VSPEC" \
        --workflows 4 --concurrency 1 --repeats 1 --out "$OUT/single-spec" || echo "single-spec failed"
    "$SLUICE" bench compare --scenario burst --quiet --history "$HISTORY" \
        --a "$A" --a-label sluice-plain --a-cmd "$SLUICE serve --port 8000 --speculative-config none" \
        --b "$B" --b-label vllm-0.32 --b-cmd "scripts/serve-vllm.sh" \
        --workflows 4 --concurrency 1 --repeats 1 --out "$OUT/single-plain" || echo "single-plain failed"
fi
