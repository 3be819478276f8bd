#!/usr/bin/env bash
# Create .venv (if missing) and install tiered-dcp with its test tools into it.
# torch: when the venv has none, install the CPU build torch==2.13.0 first, so that the
# project's torch range is satisfied without pulling several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
