#!/usr/bin/env bash
# Create .venv (if missing) and install tiered-dcp into it: what the demo needs.
#   bash scripts/setup.sh          the package (and torch, when the venv has none)
#   bash scripts/setup.sh --test   also the test tools and the integration tests' packages
# torch: when the venv has none, the CPU build torch==2.13.0 is installed first, so that the
# project's torch range is satisfied without pulling several GB of CUDA packages. pip's own
# output goes to .venv/setup.log; it is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST=0
case "${1:-}" in
  "") ;;
  --test) TEST=1 ;;
  *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/setup.log
: >"$LOG"
step() {  # step WHAT CMD...: run CMD quietly; on failure show what it said
  local what=$1
  shift
  if ! "$@" >>"$LOG" 2>&1; then
    echo "setup: $what failed; the end of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
has() { .venv/bin/python -c "$1" >/dev/null 2>&1; }
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

step "upgrading pip" pip install --upgrade pip
has "import torch" || step "installing torch==2.13.0 (CPU)" pip install "torch==2.13.0"
if [ "$TEST" = 1 ]; then
  step "installing tiered-dcp with its test tools" pip install -e ".[test]"
  # megatron-core for tests/test_megatron.py. Its wheels from 0.17 on declare Python >= 3.12
  # but run on 3.11, and its package import needs psutil and triton without declaring them:
  # installed without its dependency metadata. Skipped when already there.
  if ! has "import importlib.metadata as m; assert m.version('megatron-core') == '0.19.2'; import psutil, triton"; then
    step "installing megatron-core" pip install --no-deps --ignore-requires-python "megatron-core==0.19.2"
    step "installing megatron-core's imports" pip install numpy packaging psutil triton
  fi
  # torchtitan for tests/test_torchtitan.py (the docs' CheckpointManager recipe). Its
  # checkpoint manager and optimizers need only tyro and spmd_types besides torch; its
  # training-only dependencies (datasets, wandb, tensorboard, ...) are left out. Python >= 3.11.
  if has "import sys; sys.exit(sys.version_info < (3, 11))" &&
    ! has "import importlib.metadata as m; assert m.version('torchtitan') == '0.3.0'; import tyro, spmd_types"; then
    step "installing torchtitan" pip install --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
    step "installing tyro" pip install tyro
  fi
  # nvidia-resiliency-ext 0.7.0 for tests/test_nvrx_wrapper.py and bench_inprocess.py
  # (NVIDIA's in-process restart). Its wheels are cp312/cp314 only, but its
  # inprocess package is pure Python and runs on 3.11: unpacked into .venv/nvrx, without its
  # declared dependencies (several GB), and put on the path only by what uses it (on every
  # path, megatron-core would take NVRx's async checkpointing classes in its tests too);
  # the five packages its import needs are installed.
  if [ "$(uname -m)" = x86_64 ] && ! PYTHONPATH=.venv/nvrx has "import nvidia_resiliency_ext.inprocess"; then
    step "installing nvidia-resiliency-ext 0.7.0" pip install --no-deps --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_39_x86_64 --target .venv/nvrx "nvidia-resiliency-ext==0.7.0"
    step "installing nvidia-resiliency-ext's imports" pip install defusedxml httpx packaging pyyaml psutil
  fi
else
  step "installing tiered-dcp" pip install -e .
fi
version=$(.venv/bin/python -c "import torch, tiered_dcp; print(f'tiered-dcp {tiered_dcp.__version__}, torch {torch.__version__}')")
echo "setup: .venv ready ($version$([ "$TEST" = 1 ] && echo ", test tools"))"
