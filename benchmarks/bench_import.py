"""Importing a stock DCP checkpoint against copying its files, on the same disk.

    .venv/bin/python benchmarks/bench_import.py [--mib 512] [--runs 3]

A stock ``FileSystemWriter`` directory of ``--mib`` MiB (32 float32 tensors) is imported as
a step of a one-tier config on the local disk (``tiered_dcp.import_dcp``: read whole, then
saved, checksummed and committed), and, in the same run, its files are copied with
``shutil.copytree`` (each fsynced, as a save's are). Medians of ``--runs``; prints a table,
then JSON. Never fails on timing.
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
from common import MiB, make_state, report  # noqa: E402

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="directory on the local disk")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tdcp-bench-import-", dir=args.disk)
    try:
        stock = f"{work}/stock"
        state = make_state(args.mib)
        nbytes = sum(t.nbytes for t in state.values())
        dcp.save(state, storage_writer=dcp.FileSystemWriter(stock))
        del state
        copies, imports = [], []
        for run in range(args.runs):
            t0 = time.perf_counter()
            copy_synced(stock, f"{work}/copy{run}")
            copies.append(time.perf_counter() - t0)
            shutil.rmtree(f"{work}/copy{run}")
            cfg = TieredConfig(f"imp{run}", [Tier(f"{work}/tier")])
            t0 = time.perf_counter()
            import_dcp(cfg, stock, 1)
            imports.append(time.perf_counter() - t0)
            shutil.rmtree(f"{work}/tier")
        res = {"copy_files_s": statistics.median(copies), "import_dcp_s": statistics.median(imports)}
    finally:
        shutdown()
        shutil.rmtree(work, ignore_errors=True)
    ratios = {"import_time_vs_file_copy": res["import_dcp_s"] / res["copy_files_s"]}
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
