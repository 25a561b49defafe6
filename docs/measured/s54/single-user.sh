#!/usr/bin/env bash
# Session 54 (AMD EPYC Zen 4): issue 5's single user against vLLM 0.32 bf16 on this type again
# (last in session 35): session 35's / 49's command (4 workflows one at a time, burst scenario,
# c=1), sluice without speculation (the comparison) and, second, with its default prompt
# lookup; sluice from /work/wt-s54 (a snapshot of main at 036d100).
set -u
cd /work/main
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s54 /work/main/.venv/bin/python -m sluice.cli serve --port 8000"
.venv/bin/sluice bench compare --scenario burst --quiet --history actual --workflows 4 --concurrency 1 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-plain --a-cmd "$SL --speculative-config none" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd scripts/serve-vllm.sh \
  --repeats 2 --out bench-results/s54-single/plain
cp bench-results/s54-single/plain/compare.md docs/measured/s54/single-user-plain-vs-vllm.md
.venv/bin/sluice bench compare --scenario burst --quiet --history actual --workflows 4 --concurrency 1 \
  --a http://127.0.0.1:8000/v1 --a-label sluice-default --a-cmd "$SL" \
  --b http://127.0.0.1:8001/v1 --b-label sluice-plain --b-cmd "${SL/8000/8001} --speculative-config none" \
  --repeats 1 --out bench-results/s54-single/spec
cp bench-results/s54-single/spec/compare.md docs/measured/s54/single-user-spec-vs-plain.md
echo SINGLEDONE $(date -u +%T)
