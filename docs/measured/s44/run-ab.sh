#!/usr/bin/env bash
# Session 44 (Intel with AMX): sluice with its bf16 products on AMX tiles (the default here) against
# the same code with SLUICE_CPU_AMX=0 (the AVX-512 `vdpbf16ps` kernels of sessions 1-43), one
# sustained pair (WIN s, default 600), c=32, the default auto bound admitting by /load. Both from
# /work/wt-s44 (a snapshot of main).
set -u
cd /work/main
PY=/work/main/.venv/bin/python
WIN=${WIN:-600}
OUT=bench-results/s44-ab-$WIN
mkdir -p $OUT
SL="env PYTHONSAFEPATH=1 PYTHONPATH=/work/wt-s44 $PY -m sluice.cli serve"
.venv/bin/sluice bench compare --scenario sustained --admission load --window $WIN --quiet --history actual \
  --concurrency 32 --a http://127.0.0.1:8000/v1 --a-label sluice-amx --a-cmd "$SL --port 8000" \
  --b http://127.0.0.1:8100/v1 --b-label sluice-no-amx --b-cmd "env SLUICE_CPU_AMX=0 $SL --port 8100" \
  --repeats 1 --out $OUT
grep "workflow bound" $OUT/a.server.log > docs/measured/s44/ab-amx-bound-log.txt
grep "workflow bound" $OUT/b.server.log > docs/measured/s44/ab-noamx-bound-log.txt
echo ABDONE $(date)
