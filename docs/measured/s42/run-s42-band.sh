#!/usr/bin/env bash
# Session 42 (AMD Zen 4): a sustained pair against vLLM 0.32 bf16 at 244296d with the `auto`
# bound's band given as $1 (LOW,HIGH). Session 41's fixed-bound traces put the overhead (steps x
# ~7.5 ms fixed + idle, over the wall clock) at ~0.14 / 0.084 / 0.064 / 0.048 at 8 / 12 / 16 / 24
# workflows in flight; the bound settles just under HIGH on its way up, so 0.06,0.085 should hold
# ~12-14, where both sustained targets were met with the bound fixed at 12 (s40).
# sluice from /work/wt-s42 (a snapshot of main).
set -u
BAND=${1:?band LOW,HIGH}
TAG=${2:-band-$BAND}
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s42-sustained-$TAG
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s42 $PY -m sluice.cli serve --auto-overhead-band $BAND"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s42/$TAG-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-band-$BAND --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT
grep "workflow bound" $OUT/a.server.log > docs/measured/s42/$TAG-bound-log.txt
echo SUSTAINEDDONE $(date)
