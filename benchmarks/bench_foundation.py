"""Side-by-side figures for the foundation: sync save, load, async_save stall.

    .venv/bin/python benchmarks/bench_foundation.py [--mib 512] [--runs 5]

Every figure is the median of ``--runs`` runs and is compared, as a ratio, against a
baseline measured in the same run on the same bytes: a raw write+fsync, torch's stock
FileSystemWriter / FileSystemReader, and a warm memcpy. Prints a table, then JSON.
Never fails on timing.
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

import torch
import torch.distributed.checkpoint as dcp
from common import MiB, exit_on_sigterm, make_state, report  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter
from tiered_dcp.tensors import byte_view

warnings.filterwarnings("ignore")


def timed(fn, runs: int, setup=None) -> float:
    times = []
    for _ in range(runs):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def raw_write(state: dict, path: str, fsync: bool = True) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state.values():
            view = byte_view(t)
            while view:
                view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    ap.add_argument("--runs", type=int, default=5, help="runs per figure; the median is reported")
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="directory on the local disk")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    state = make_state(args.mib)
    nbytes = sum(t.nbytes for t in state.values())
    disk = tempfile.mkdtemp(prefix="tdcp-bench-", dir=args.disk)
    shm = tempfile.mkdtemp(prefix="tdcp-bench-", dir="/dev/shm") if os.path.isdir("/dev/shm") else disk
    res: dict[str, float] = {}
    try:
        ssd_cfg = TieredConfig("bench", [Tier(f"{disk}/ssd")])
        ram_cfg = TieredConfig("bench", [Tier(f"{shm}/ram")])
        step = iter(range(1, 10**6))

        def clear(path):
            return lambda: shutil.rmtree(path, ignore_errors=True)

        # --- sync save to a local (disk) tier vs raw write+fsync vs stock FileSystemWriter
        res["raw_write_fsync_s"] = timed(
            lambda: raw_write(state, f"{disk}/raw.bin"),
            args.runs,
            setup=lambda: os.path.exists(f"{disk}/raw.bin") and os.remove(f"{disk}/raw.bin"),
        )
        res["tiered_sync_save_s"] = timed(
            lambda: dcp.save(state, storage_writer=TieredWriter(ssd_cfg, step=next(step))),
            args.runs,
            setup=clear(f"{disk}/ssd"),
        )
        res["stock_sync_save_s"] = timed(
            lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{disk}/stock")),
            args.runs,
            setup=clear(f"{disk}/stock"),
        )
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{disk}/stock"))

        # --- sync save to the RAM tier vs a raw write of the same bytes to /dev/shm (a new file)
        res["raw_write_shm_s"] = timed(
            lambda: raw_write(state, f"{shm}/raw.bin", fsync=False),
            args.runs,
            setup=lambda: os.path.exists(f"{shm}/raw.bin") and os.remove(f"{shm}/raw.bin"),
        )
        res["tiered_sync_save_ram_s"] = timed(
            lambda: dcp.save(state, storage_writer=TieredWriter(ram_cfg, step=next(step))),
            args.runs,
            setup=clear(f"{shm}/ram"),
        )

        # --- load from the RAM tier vs stock FileSystemReader from the disk directory
        dcp.save(state, storage_writer=TieredWriter(ram_cfg, step=1))
        target = {k: torch.empty_like(v) for k, v in state.items()}
        res["tiered_ram_load_s"] = timed(
            lambda: dcp.load(target, storage_reader=TieredReader(ram_cfg)), args.runs
        )
        assert all(torch.equal(target[k], state[k]) for k in state)
        res["stock_disk_load_s"] = timed(
            lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(f"{disk}/stock")), args.runs
        )

        # --- async_save: how long the training loop is blocked
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for k in state:  # warm the destination buffers
            dst[k].copy_(state[k])
        res["warm_memcpy_s"] = timed(lambda: [dst[k].copy_(state[k]) for k in state], args.runs)

        def stall(make_writer):
            futs = []

            def go():
                futs.append(dcp.async_save(state, storage_writer=make_writer()))

            t = timed(go, args.runs, setup=lambda: [f.result() for f in futs])
            for f in futs:
                f.result()
            return t

        res["tiered_async_stall_s"] = stall(lambda: TieredWriter(ram_cfg, step=next(step)))
        res["stock_async_stall_s"] = stall(lambda: dcp.FileSystemWriter(f"{disk}/stock-async"))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        if shm != disk:
            shutil.rmtree(shm, ignore_errors=True)

    ratios = {
        "sync_save_throughput_vs_raw_write_fsync": res["raw_write_fsync_s"] / res["tiered_sync_save_s"],
        "ram_sync_save_time_vs_raw_shm_write": res["tiered_sync_save_ram_s"] / res["raw_write_shm_s"],
        "sync_save_speedup_vs_stock_writer": res["stock_sync_save_s"] / res["tiered_sync_save_s"],
        "ram_load_speedup_vs_stock_reader": res["stock_disk_load_s"] / res["tiered_ram_load_s"],
        "async_stall_vs_warm_memcpy": res["tiered_async_stall_s"] / res["warm_memcpy_s"],
        "stock_async_stall_vs_warm_memcpy": res["stock_async_stall_s"] / res["warm_memcpy_s"],
        "async_stall_reduction_vs_stock": res["stock_async_stall_s"] / res["tiered_async_stall_s"],
    }
    targets = {
        "sync_save_throughput_vs_raw_write_fsync": (">=", 0.85),
        "ram_sync_save_time_vs_raw_shm_write": ("<=", 1.1),
        "ram_load_speedup_vs_stock_reader": (">=", 2),
        "async_stall_vs_warm_memcpy": ("<=", 1.3),
        "async_stall_reduction_vs_stock": (">=", 2.5),
    }
    report(
        f"state: {nbytes / MiB:.0f} MiB in {len(state)} tensors; median of {args.runs} runs",
        nbytes,
        res,
        ratios,
        targets,
    )
    print(json.dumps({"bytes": nbytes, "runs": args.runs, "seconds": res, "ratios": ratios}))


if __name__ == "__main__":
    main()
