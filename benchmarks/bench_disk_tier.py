"""The disk tier at the disk's pace: the writer's copy of a step and a cold load from it, beside
dd's direct I/O of the same bytes to the same directory, in the same run.

    .venv/bin/python benchmarks/bench_disk_tier.py [--gib 1 4] [--runs 3] [--disk DIR]

Per step size and run, one after the other on the same disk:

- **tier copy**: ``dcp.save`` of the state onto a RAM tier (/dev/shm) over a disk tier in
  ``--disk``; from the step's commit on RAM to its commit on the disk (the markers' times: the
  writer process reads the RAM tier, checks every chunk, writes the part, syncs, commits);
  of which ``writer_write_s``, the part's bytes alone (the writer's own record);
- **dd direct**: ``dd oflag=direct conv=fsync bs=8M`` of the RAM tier's part file (the same
  bytes) into ``--disk``; **dd buffered**: the same with ``conv=fsync`` alone;
- **cold load**: the disk tier's files dropped from the page cache (``POSIX_FADV_DONTNEED``, as
  after a reboot), ``dcp.load`` from the disk tier (a config naming it alone), every byte
  checked; **dd read**: ``dd iflag=direct bs=8M`` of the part file itself, dropped the same
  way; each twice, in the order load, dd, dd, load (or the reverse), each the mean of its two;
- **warm load**: the same load once the files are in the page cache (read in first);
- what the step leaves in the page cache once committed on the disk: its part file's
  resident pages (``mincore``) and ``/proc/meminfo``'s Dirty + Writeback (the whole machine's).

Medians of ``--runs``; ratios to dd in the same run. Never fails on the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from common import MiB, exit_on_sigterm
from tiered_dcp.storage.direct_io import resident_pages
from tiered_dcp.storage.format import is_part_name, step_dir

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, status, wait_for
from tiered_dcp.writer_process.timings import Kind, read_records

warnings.filterwarnings("ignore")
SHOWN = ("copy_s", "writer_write_s", "dd_direct_s", "dd_buffered_s")
SHOWN += ("cold_load_s", "dd_read_s", "warm_load_s")
SETTLE_S = 6.0  # ext4 mounted with discard sends them at its journal commit (every 5 s)
TARGETS = {"copy_vs_dd_direct": 0.8, "cold_load_vs_dd_read": 0.8}


def make_state(gib: int) -> dict:
    """``gib`` GiB in 1 GiB float32 tensors of random bits (nothing for a disk to compress)."""
    g = torch.Generator().manual_seed(gib)
    return {f"w{i}": torch.randn(MiB * 256, generator=g) for i in range(gib)}


def dd(*args: str) -> float:
    """Seconds ``dd`` took (its own clock, as it prints it)."""
    out = subprocess.run(["dd", *args, "bs=8M"], capture_output=True, text=True, check=True).stderr
    return float(out.strip().splitlines()[-1].split(" copied, ")[1].split(" s")[0])


def drop_cached(root: str) -> None:
    """Every file under ``root`` out of the page cache (written back first)."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_in(root: str) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                while f.read(64 * MiB):
                    pass


def dirty_mib() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) for k in ("Dirty", "Writeback")) / 1024


def cached_pages(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_pages(fd)[0]
    finally:
        os.close(fd)


def part_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, ns in os.walk(root) for n in ns if is_part_name(n)]


def abba(a: Callable[[], float], b: Callable[[], float]) -> tuple[float, float]:
    """``a`` and ``b`` timed in the order a, b, b, a, each the mean of its two: a disk still
    busy with what came before (a VM's disk has its host's cache and discards behind it)
    slows whichever goes first, and the pairs cancel that drift."""
    first_a, first_b = a(), b()
    second_b, second_a = b(), a()
    return (first_a + second_a) / 2, (first_b + second_b) / 2


def one_run(run: int, state: dict, shm: str, disk: str) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    ram, ssd = f"{shm}/ram{run}", f"{disk}/ssd{run}"
    cfg = TieredConfig(f"benchd{run}", [Tier(ram, keep=2), Tier(ssd, keep=2)])
    res: dict = {"resident_pages": 0, "dirty_after_commit_mib": 0.0}
    steps = iter((1, 2))

    def copy() -> float:
        step = next(steps)
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
        wait_for(cfg, step, timeout=300)
        res["dirty_after_commit_mib"] = max(res["dirty_after_commit_mib"], dirty_mib())
        res["resident_pages"] += sum(map(cached_pages, part_files(f"{ssd}/{step_dir(f'benchd{run}', step)}")))
        marks = {r.tier_index: r.created for r in status(cfg) if r.step == step and r.state == "committed"}
        return marks[1] - marks[0]

    outs = iter(f"{disk}/dd{run}-{i}.bin" for i in range(3))
    src = None

    def dd_direct() -> float:
        nonlocal src
        src = src or part_files(ram)[0]
        return dd(f"if={src}", f"of={next(outs)}", "oflag=direct", "conv=fsync")

    res["copy_s"], res["dd_direct_s"] = abba(copy, dd_direct)
    res["writer_write_s"] = statistics.mean(r.write_s for r in read_records(cfg, Kind.PERSIST))
    res["dd_buffered_s"] = dd(f"if={src}", f"of={next(outs)}", "conv=fsync")
    shutdown(wait=True, timeout=120)
    shutil.rmtree(ram, ignore_errors=True)  # the RAM tier's memory back before the loads

    alone = TieredConfig(f"benchd{run}", [Tier(ssd, keep=2)])
    target = {k: torch.zeros_like(v) for k, v in state.items()}  # a model's tensors: there already
    part = part_files(f"{ssd}/{step_dir(f'benchd{run}', 2)}")[0]

    def cold_load() -> float:
        drop_cached(ssd)
        started = time.monotonic()
        dcp.load(target, storage_reader=TieredReader(alone, step=2))
        return time.monotonic() - started

    def dd_read() -> float:  # the same bytes where they lie: the part file itself
        drop_cached(ssd)
        return dd(f"if={part}", "of=/dev/null", "iflag=direct")

    res["cold_load_s"], res["dd_read_s"] = abba(cold_load, dd_read)
    assert all(torch.equal(target[k], state[k]) for k in state), "the cold load is not the state saved"
    read_in(ssd)
    started = time.monotonic()
    dcp.load(target, storage_reader=TieredReader(alone, step=2))
    res["warm_load_s"] = time.monotonic() - started
    for left in (ssd, *(f"{disk}/dd{run}-{i}.bin" for i in range(3))):
        shutil.rmtree(left) if os.path.isdir(left) else os.unlink(left)
    os.sync()
    time.sleep(SETTLE_S)  # the file system's discards of what was removed, before the next run
    res["gb"] = nbytes / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, nargs="+", default=[1, 4], help="step sizes in GiB (default 1 4)")
    ap.add_argument("--runs", type=int, default=3, help="runs per size; medians are reported")
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="a directory on the disk (default: /tmp)")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    shm = tempfile.mkdtemp(prefix="tdcp-benchd-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="tdcp-benchd-", dir=args.disk)
    report = {}
    try:
        for gib in args.gib:
            state = make_state(gib)
            runs = [one_run(i, state, shm, disk) for i in range(args.runs)]
            del state
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            gb = med["gb"]
            ratios = {
                "copy_vs_dd_direct": [r["dd_direct_s"] / r["copy_s"] for r in runs],
                "copy_vs_dd_buffered": [r["dd_buffered_s"] / r["copy_s"] for r in runs],
                "cold_load_vs_dd_read": [r["dd_read_s"] / r["cold_load_s"] for r in runs],
                "warm_load_vs_cold": [r["cold_load_s"] / r["warm_load_s"] for r in runs],
            }
            print(f"\n{gib} GiB step, {args.runs} runs (medians; GB/s = {gb:.2f} GB / seconds)")
            for k in (
                "copy_s",
                "writer_write_s",
                "dd_direct_s",
                "dd_buffered_s",
                "cold_load_s",
                "dd_read_s",
                "warm_load_s",
            ):
                print(f"  {k:<16}{med[k]:>8.3f} s {gb / med[k]:>7.2f} GB/s")
            print(f"  part file pages cached after the disk commit: {[r['resident_pages'] for r in runs]}")
            dirty = [round(r["dirty_after_commit_mib"]) for r in runs]
            print(f"  Dirty+Writeback after the disk commit (MiB, machine-wide): {dirty}")
            for k, v in ratios.items():
                target = f"  (target >= {TARGETS[k]})" if k in TARGETS else ""
                print(f"  {k:<22}{statistics.median(v):>6.2f}  runs {[round(x, 2) for x in v]}{target}")
            report[f"{gib}GiB"] = {"medians": med, "ratios": ratios, "runs": runs}
    finally:
        shutdown(wait=True, timeout=60)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
