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
# megatron-core for tests/test_megatron.py. Its wheels from 0.17 on declare Python >= 3.12
# but run on 3.11, and its package import needs psutil and triton without declaring them:
# installed without its dependency metadata. Skipped when already there.
if ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('megatron-core') == '0.19.2'; import psutil, triton" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
  .venv/bin/python -m pip install -q numpy packaging psutil triton
fi
# torchtitan for tests/test_torchtitan.py (the docs' CheckpointManager recipe). Its
# checkpoint manager and optimizers need only tyro and spmd_types besides torch; its
# training-only dependencies (datasets, wandb, tensorboard, ...) are left out. Python >= 3.11.
if .venv/bin/python -c "import sys; sys.exit(sys.version_info < (3, 11))" &&
  ! .venv/bin/python -c "import importlib.metadata as m; assert m.version('torchtitan') == '0.3.0'; import tyro, spmd_types" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
  .venv/bin/python -m pip install -q tyro
fi
