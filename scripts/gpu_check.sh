#!/usr/bin/env bash
# One prepared run on a lent GPU machine (torch there, no internet): the GPU tests and
# benchmarks/bench_cuda.py, results under $OUT. Prepare here first (wheels in .whl, ignored):
#   bash scripts/gpu_check.sh --prepare
# then, through the device tool, with carry [".whl"] and timeout_s 540:
#   bash scripts/gpu_check.sh
# About 5 min on an H100 (tests ~1 min, bench_cuda's train part ~2.5, its other parts ~1.5);
# each step has its own cap (timeout: 90 + 240 + 150 s, 8 min in all), and each bench_cuda
# part prints its figures as it ends, so a step cut short keeps what it printed. To rerun one
# part: python3 benchmarks/bench_cuda.py --only train (or exact, load, stall), from /tmp.
# bash scripts/gpu_check.sh train: the tests and the train part alone (~3 min), with the RAM
# tier alone beside the README's tiers (the writer process's share of the stalls).
# bash scripts/gpu_check.sh inprocess: the tests and the recovery inside the job with
# CUDA states (bench_inprocess.py --device cuda: 4 ranks on the one card, NvRx 0.7.0's Wrapper
# from the wheels --prepare put in .whl/nvrx, beside torchrun restarts; ~3 min).
# bash scripts/gpu_check.sh disk: the tests and the disk tier against dd's direct I/O on
# that host's disk (bench_disk_tier.py, 1 and 4 GiB steps) and the CPU stall series with the
# disk tier on (bench_async.py --series); ~5 min.
# bash scripts/gpu_check.sh every-step: the tests and the loop (bench_cuda.py's train part,
# model + AdamW 3.22 GB): a save every step and every 10 (60 steps each) with background
# staging, tiered-dcp beside stock's pinned DefaultStager with async staging and no saves; then
# the host side's commit rate (bench_every_step.py, one rank and replicated); ~5 min.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
  rm -rf .whl && mkdir -p .whl
  .venv/bin/python -m pip wheel -q --no-deps -w .whl . || exit 1
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "zstandard>=0.22" || exit 1
  plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_39_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  .venv/bin/python -m pip download -q --no-deps "${plat[@]}" -d .whl/nvrx "nvidia-resiliency-ext==0.7.0" || exit 1
  .venv/bin/python -m pip download -q "${plat[@]}" -d .whl/nvrx defusedxml httpx packaging pyyaml psutil || exit 1
  ls .whl .whl/nvrx
  exit 0
fi
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
repo=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
df -h /dev/shm /tmp | tee -a "$OUT/gpu.txt"  # the RAM tiers and the disk tiers
# from outside the checkout: the installed package, not the tree (the writer process is
# started as python -m tiered_dcp.writer_process.process and would import the tree's tiered_dcp/)
cd /tmp || exit 1
# a step past its cap gets SIGINT (its cleanup runs), then SIGKILL 15 s later; what it left
# in /dev/shm and /tmp is removed before the next step
clean() { rm -rf /dev/shm/tdcp-cuda-* /tmp/tdcp-cuda-*; }
# bench FILE SECONDS COMMAND...: its lines as they come into $OUT/FILE (DCP's INFO log lines
# left out; an uncaught error's "[rank0]: ..." traceback kept), the last 80 on the console
bench() {
  local file=$1
  shift
  timeout -s INT -k 15 "$@" 2>&1 | grep --line-buffered -v ' - INFO - ' | tee "$OUT/$file" | tail -80
}
timeout -s INT -k 15 90 python3 -m pytest -q -p no:cacheprovider "$repo/tests/gpu" 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
clean
# model + AdamW (3.22 GB), a save every 10 steps (80) and every 30 (120), tiered-dcp
# vs stock pinned vs no saves
if [ "${1:-}" = inprocess ]; then  # NvRx where bench_inprocess looks for it: the tree's .venv/nvrx
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$repo/.venv/nvrx" "$repo"/.whl/nvrx/*.whl 2>&1 | tail -3
  bench bench_inprocess.txt 400 python3 "$repo/benchmarks/bench_inprocess.py" --device cuda --mib 64 --rounds 1
  clean
  exit 0
fi
if [ "${1:-}" = disk ]; then
  df -T /tmp | tee "$OUT/disk.txt"
  bench bench_disk_tier.txt 270 python3 "$repo/benchmarks/bench_disk_tier.py" --gib 1 4 --runs 3
  rm -rf /dev/shm/tdcp-benchd-* /tmp/tdcp-benchd-*
  bench bench_async_series.txt 180 python3 "$repo/benchmarks/bench_async.py" --series --tensors 8 --runs 3
  rm -rf /dev/shm/tdcp-bench-* /tmp/tdcp-bench-*
  exit 0
fi
if [ "${1:-}" = every-step ]; then
  bench bench_every_step_loop.txt 300 python3 "$repo/benchmarks/bench_cuda.py" --only train --train-gib 3.0 \
    --train-loops 60:1 60:10 --train-ways none tiered_bg stock_bg
  clean
  bench bench_every_step.txt 150 python3 "$repo/benchmarks/bench_every_step.py" --mib 1024 --saves 8
  rm -rf /dev/shm/tdcp-bench-every-*
  exit 0
fi
ways=(none tiered_dcp stock_pinned)
[ "${1:-}" = train ] && ways+=(tiered_ram_only)
bench bench_train.txt 240 python3 "$repo/benchmarks/bench_cuda.py" --only train --train-gib 3.0 \
  --train-loops 80:10 120:30 --train-ways "${ways[@]}"
clean
[ "${1:-}" = train ] && exit 0
bench bench_cuda.txt 150 python3 "$repo/benchmarks/bench_cuda.py" --skip train --mib 1024 --steps 6 \
  --load-gib 3.0 --load-runs 3
clean
