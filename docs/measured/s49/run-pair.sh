#!/usr/bin/env bash
# Session 49 (Intel with AMX, family 6 model 167): a sustained pair against vLLM 0.32 bf16 (sessions 39-46's
# command: 600 s, c=32, --history actual, sluice admitting by /load, vLLM on the closed loop) at 632c936
# (the GGUF's Q4_1 and Q8_0 weights kept in their blocks, the default), sluice with a fixed bound of FIXED workflows in flight
# (default 16); then sluice alone with its default auto bound, same command, against the same vLLM run.
set -u
cd /work/main
PY=/work/main/.venv/bin/python
OUT=bench-results/s49-sustained${TAG:-}
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s49 $PY -m sluice.cli serve"
( for i in $(seq 1 90); do r=$(curl -s --max-time 2 http://127.0.0.1:8000/load) && echo "$(date -u +%T) $r"; sleep 10; done ) > docs/measured/s49/pair${TAG:-}-load-poll.txt 2>&1 &
.venv/bin/sluice bench compare --scenario sustained --admission load --window 600 --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-s49-bound${FIXED:-16} --a-cmd "$SL --port 8000 --max-active-workflows ${FIXED:-16}" \
  --b http://127.0.0.1:8100/v1 --b-label vllm-0.32-bf16 --b-cmd "scripts/serve-vllm.sh" \
  --repeats 1 --out $OUT/pair
echo PAIRDONE $(date -u +%T)
[ -n "${SKIP_AUTO:-}" ] && exit 0
F=auto
$SL --port 8002 > $OUT/fixed$F.server.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8002/health >/dev/null && break; sleep 1; done
.venv/bin/sluice bench sustained --quiet --history actual --admission load --base-url http://127.0.0.1:8002/v1 \
  --window 600 --concurrency 32 --repeats 1 --label sluice-s49-auto --out $OUT/fixed$F > $OUT/fixed$F.txt 2>&1
curl -s http://127.0.0.1:8002/metrics > $OUT/fixed$F-metrics.txt
kill $SP; wait $SP
grep "workflow bound" $OUT/fixed$F.server.log > docs/measured/s49/auto-bound-log.txt
echo FIXEDDONE $(date -u +%T)
