"""A sync ``dcp.save`` to a RAM tier against a raw write of the same bytes to /dev/shm.

    .venv/bin/python benchmarks/bench_sync_ram.py [--mib 512] [--rounds 8]

The two alternate in one process, round after round (each into fresh files), so that a
noisy shared host slows both alike; the median of each and their ratio are reported
(target: the save within 1.1x of the raw write). Prints a table, then JSON. Never fails
on timing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch.distributed.checkpoint as dcp
from bench_foundation import raw_write
from common import MiB, exit_on_sigterm, make_state, report  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown

warnings.filterwarnings("ignore")
logging.getLogger("tiered_dcp").setLevel(logging.ERROR)  # keep=None on a RAM tier warns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    state = make_state(args.mib)
    nbytes = sum(t.nbytes for t in state.values())
    shm = tempfile.mkdtemp(prefix="tdcp-bench-", dir="/dev/shm")
    cfg = TieredConfig("bench", [Tier(f"{shm}/ram")])
    raw, save = [], []
    try:
        for step in range(args.rounds + 1):  # the first round warms up (imports, thread pools)
            shutil.rmtree(f"{shm}/ram", ignore_errors=True)
            t0 = time.perf_counter()
            raw_write(state, f"{shm}/raw.bin", fsync=False)
            t1 = time.perf_counter()
            os.remove(f"{shm}/raw.bin")
            t2 = time.perf_counter()
            dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
            t3 = time.perf_counter()
            if step:
                raw.append(t1 - t0)
                save.append(t3 - t2)
    finally:
        shutdown()
        shutil.rmtree(shm, ignore_errors=True)
    res = {"raw_write_shm_s": statistics.median(raw), "tiered_sync_save_ram_s": statistics.median(save)}
    ratios = {"ram_sync_save_time_vs_raw_shm_write": res["tiered_sync_save_ram_s"] / res["raw_write_shm_s"]}
    report(
        f"state: {nbytes / MiB:.0f} MiB in {len(state)} tensors; medians of {args.rounds} alternating rounds",
        nbytes,
        res,
        ratios,
        {"ram_sync_save_time_vs_raw_shm_write": ("<=", 1.1)},
    )
    print(json.dumps({"bytes": nbytes, "rounds": args.rounds, "seconds": res, "ratios": ratios}))


if __name__ == "__main__":
    main()
