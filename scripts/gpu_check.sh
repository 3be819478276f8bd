#!/usr/bin/env bash
# One prepared run on a lent GPU machine (torch there, no internet): the GPU tests and
# benchmarks/bench_cuda.py, results under $OUT. Prepare here first (wheels in .whl, ignored):
#   bash scripts/gpu_check.sh --prepare
# then, through the device tool, with carry [".whl"]:
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
  rm -rf .whl && mkdir -p .whl
  .venv/bin/python -m pip wheel -q --no-deps -w .whl . || exit 1
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "zstandard>=0.22" || exit 1
  ls .whl
  exit 0
fi
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
repo=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# from outside the checkout: the installed package, not the tree (the writer process is
# started as python -m tiered_dcp.persist and would import the tree's tiered_dcp/)
cd /tmp || exit 1
timeout 240 python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu" 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
timeout 300 python3 "$repo/benchmarks/bench_cuda.py" --mib 1024 --steps 6 --load-gib 3.0 --load-runs 3 \
  2>&1 | grep -v '^\[' | tail -40 | tee "$OUT/bench_cuda.txt"
