#!/usr/bin/env bash
# Soak sluice: start `sluice serve`, run `sluice bench soak` against it for MINUTES, then SIGTERM
# the server and check that it drains and exits 0. Exit status 0 only if the soak passed (no failed
# accepted call, no 5xx, no leaked KV block, memory growth within bound) and the server exited 0.
# See docs/reliability.md.
#
#   scripts/soak.sh [MINUTES] [extra `sluice bench soak` arguments...]      (default 30 minutes)
#
# Environment (all optional):
#   PORT             where the server listens on 127.0.0.1              (default 8300)
#   SERVE_ARGS       extra `sluice serve` arguments   (default: 2048-token context, 32768 KV tokens)
#   OUT              folder for server.log and soak.json       (default soak-results/<time>)
#   CONCURRENCY      workflow slots                                      (default 16)
#   SCALE            workload --scale (token lengths and tool latencies)  (default 0.5)
#   WARMUP           seconds before the memory baseline                  (default 300, or a fifth
#                    of the run when that is shorter)
#   MAX_RSS_GROWTH   bound on resident memory growth after the warm-up, MiB (default 128)
set -euo pipefail

cd "$(dirname "$0")/.."
MINUTES="${1:-30}"
shift || true
PORT="${PORT:-8300}"
SERVE_ARGS="${SERVE_ARGS:---max-model-len 2048 --kv-cache-tokens 32768}"
OUT="${OUT:-soak-results/$(date +%Y%m%d-%H%M%S)}"
CONCURRENCY="${CONCURRENCY:-16}"
SCALE="${SCALE:-0.5}"
DURATION=$(python3 -c "print(float($MINUTES) * 60)")
WARMUP="${WARMUP:-$(python3 -c "print(min(300.0, $DURATION / 5))")}"
MAX_RSS_GROWTH="${MAX_RSS_GROWTH:-128}"
PY="${PY:-.venv/bin/python}"

mkdir -p "$OUT"
# shellcheck disable=SC2086
"$PY" -m sluice.cli serve --host 127.0.0.1 --port "$PORT" $SERVE_ARGS >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -KILL $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "server exited; see $OUT/server.log" >&2; exit 1; fi
    sleep 1
done

set +e
"$PY" -m sluice.cli bench soak --base-url "http://127.0.0.1:$PORT/v1" \
    --duration "$DURATION" --warmup "$WARMUP" --concurrency "$CONCURRENCY" --scale "$SCALE" \
    --max-rss-growth-mib "$MAX_RSS_GROWTH" --report "$OUT/soak.json" "$@"
SOAK=$?
kill -TERM $SERVER
wait $SERVER
SERVER_EXIT=$?
set -e
trap - EXIT

echo "soak exit $SOAK, server exit $SERVER_EXIT after SIGTERM; report $OUT/soak.json, log $OUT/server.log"
[ "$SOAK" -eq 0 ] && [ "$SERVER_EXIT" -eq 0 ]
