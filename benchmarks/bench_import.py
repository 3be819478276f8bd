"""Importing a stock DCP checkpoint against copying its files, on the same disk.

    .venv/bin/python benchmarks/bench_import.py [--mib 512] [--runs 3]

A stock ``FileSystemWriter`` directory of ``--mib`` MiB (32 float32 tensors) is imported as
a step of a one-tier config on the local disk (``tiered_dcp.import_dcp``: its tensors copied
by the kernel into the part file, checked against their CRC-32, checksummed and committed;
see ``tiered_dcp/ops/import_dcp.py``), and, in the same run, its files are copied with
``shutil.copytree`` (each fsynced, as a save's are: the kernel copies page cache to page
cache, ``copy_file_range``), and read into memory and written back with ``write()``
(``rewrite_synced``: the way open to anything that changes the bytes, as an import does).
The three take turns going first, each after the disk has written back what came before
(``settle_disk``). Medians of
``--runs``; prints a table, then JSON. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch.distributed.checkpoint as dcp
from common import MiB, exit_on_sigterm, make_state, report  # noqa: E402

from tiered_dcp import Tier, TieredConfig, import_dcp, shutdown

warnings.filterwarnings("ignore")


def copy_synced(src: str, dst: str) -> None:
    shutil.copytree(src, dst)
    for name in os.listdir(dst):
        fd = os.open(os.path.join(dst, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def rewrite_synced(src: str, dst: str) -> None:
    """The files read into memory and written back with write() (8 MiB at a time), each
    fsynced: what any program that changes the bytes on the way must do."""
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f:
            data = memoryview(f.read())
        fd = os.open(os.path.join(dst, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for i in range(0, len(data), 8 << 20):
                os.write(fd, data[i : i + (8 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)


def settle_disk() -> None:
    """Let the disk write back what earlier writes left dirty before the next timed one: on
    this VM a write right after another waits for the first one's writeback (a fresh 512 MiB
    write+fsync takes 0.4 s, the same right after 1 GiB of others 1.6 s), which would favour
    whichever goes first."""
    os.sync()
    time.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="directory on the local disk")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    work = tempfile.mkdtemp(prefix="tdcp-bench-import-", dir=args.disk)
    try:
        stock = f"{work}/stock"
        state = make_state(args.mib)
        nbytes = sum(t.nbytes for t in state.values())
        dcp.save(state, storage_writer=dcp.FileSystemWriter(stock))
        del state
        ways = {
            "copy_files_s": lambda run: copy_synced(stock, f"{work}/copy{run}"),
            "read_write_files_s": lambda run: rewrite_synced(stock, f"{work}/rw{run}"),
            "import_dcp_s": lambda run: import_dcp(
                TieredConfig(f"imp{run}", [Tier(f"{work}/tier{run}")]), stock, 1
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in ways}
        for run in range(args.runs):
            names = list(ways)[run % 3 :] + list(ways)[: run % 3]  # none always goes first
            for name in names:
                settle_disk()
                t0 = time.perf_counter()
                ways[name](run)
                times[name].append(time.perf_counter() - t0)
            for d in (f"copy{run}", f"rw{run}", f"tier{run}"):
                shutil.rmtree(f"{work}/{d}")
        res = {k: statistics.median(v) for k, v in times.items()}
    finally:
        shutdown()
        shutil.rmtree(work, ignore_errors=True)
    ratios = {
        "import_time_vs_file_copy": res["import_dcp_s"] / res["copy_files_s"],
        "import_time_vs_read_and_write": res["import_dcp_s"] / res["read_write_files_s"],
    }
    report(
        f"stock DCP checkpoint: {nbytes / MiB:.0f} MiB; median of {args.runs} runs",
        nbytes,
        res,
        ratios,
        {"import_time_vs_file_copy": ("<=", 1.5)},
    )
    print(json.dumps({"bytes": nbytes, "runs": args.runs, "seconds": res, "ratios": ratios}))


if __name__ == "__main__":
    main()
