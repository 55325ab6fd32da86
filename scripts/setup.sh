#!/usr/bin/env bash
# Sets up .venv with asynct and its dev extras. Where no NVIDIA GPU is present it installs the
# CPU build of torch first (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch>=2.4,<2.15"
  else
    .venv/bin/python -m pip install -q torch==2.13.0
  fi
fi
.venv/bin/python -m pip install -q -e ".[dev]"
