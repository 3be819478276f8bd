"""How long async_save blocks the training loop, and how long until the step is safe.

    .venv/bin/python benchmarks/bench_async.py [--mib 512] [--runs 5] [--tensors 32]

Modes, each the median of ``--runs`` runs after one discarded warm-up run, on one state of
``--mib`` MiB in ``--tensors`` float32 tensors (single process, no process group; many
small tensors show the per-value cost of staging):

- ``memcpy``: a warm copy of the same bytes into preallocated tensors (the baseline);
- ``stock_stall``: ``dcp.async_save`` with torch's stock ``FileSystemWriter`` (its stager);
- ``tiered_stall``: ``dcp.async_save`` with a ``TieredWriter`` over three tiers (RAM in
  /dev/shm, a disk directory, a zstd "bucket" directory); ``fast_commit`` is the time until
  the returned future is done (committed on the RAM tier), ``slow_commit`` until
  ``wait_for`` says it is committed on every tier;
- ``tiered_bg_stall``: the same with ``background_staging=True``; ``bg_staging_done`` is
  the time until the response's ``staging_completion`` is done.

The modes run round-robin (one run of each per round) so that all of them see the same
machine noise; after each tiered save the writer process is left to finish (untimed).
Prints a table, then one line of JSON. Never fails on timing.
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
from common import MiB, make_state, report  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown, wait_for, writer_status
from tiered_dcp.rundir import job_dir

warnings.filterwarnings("ignore")


def median_after_warmup(samples: list[float]) -> float:
    """The median of the runs, the first (warm-up) one discarded."""
    return statistics.median(samples[1:])


class Bench:
    """One run of each mode per round, so that every mode sees the same machine noise."""

    def __init__(self, state: dict, config: TieredConfig, disk: str) -> None:
        self.state = state
        self.config = config
        self.disk = disk
        self.dst = {k: torch.empty_like(v) for k, v in state.items()}
        self.steps = iter(range(1, 10**6))
        self.times: dict[str, list[float]] = {}

    def record(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def memcpy(self) -> None:
        t0 = time.perf_counter()
        for k, v in self.state.items():
            self.dst[k].copy_(v)
        self.record("memcpy_s", time.perf_counter() - t0)

    def stock(self, i: int) -> None:
        path = f"{self.disk}/stock-{i}"
        t0 = time.perf_counter()
        fut = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(path))
        self.record("stock_stall_s", time.perf_counter() - t0)
        fut.result()
        shutil.rmtree(path, ignore_errors=True)

    def tiered(self, background: bool) -> None:
        """Stall, then commit on the fastest tier, then on every tier (and bg staging)."""
        mode = "tiered_bg" if background else "tiered"
        step = next(self.steps)
        next(iter(self.state.values())).add_(1)  # a training step changed the state
        writer = TieredWriter(self.config, step=step, background_staging=background)
        t0 = time.perf_counter()
        resp = dcp.async_save(self.state, storage_writer=writer)
        self.record(f"{mode}_stall_s", time.perf_counter() - t0)
        if background:
            assert isinstance(resp, AsyncSaveResponse), type(resp)
            resp.staging_completion.result()
            self.record(f"{mode}_staging_done_s", time.perf_counter() - t0)
            resp.upload_completion.result()
        else:
            resp.result()
        self.record(f"{mode}_fast_commit_s", time.perf_counter() - t0)
        wait_for(self.config, step, timeout=300)
        self.record(f"{mode}_slow_commit_s", time.perf_counter() - t0)
        self.settle()

    def settle(self, timeout: float = 60.0) -> None:
        """Wait (untimed) until the writer has finished its jobs' tails: retention, unpinning.

        A step counts as committed before its writer prunes older steps; without this, that
        pruning runs during the next round's timed copies.
        """
        deadline = time.monotonic() + timeout
        while any(w.queue for w in writer_status(self.config)) and time.monotonic() < deadline:
            time.sleep(0.01)

    def run(self, runs: int) -> dict[str, float]:
        for i in range(runs + 1):  # round 0 is the warm-up of every mode
            self.memcpy()
            self.stock(i)
            self.tiered(background=False)
            self.tiered(background=True)
        return {k: median_after_warmup(v) for k, v in self.times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    ap.add_argument(
        "--runs", type=int, default=5, help="runs per mode after one warm-up; the median is reported"
    )
    ap.add_argument("--tensors", type=int, default=32, help="number of tensors (default 32)")
    args = ap.parse_args()
    state = make_state(args.mib, args.tensors)
    nbytes = sum(t.nbytes for t in state.values())
    disk = tempfile.mkdtemp(prefix="tdcp-bench-async-")
    shm = tempfile.mkdtemp(prefix="tdcp-bench-async-", dir="/dev/shm") if os.path.isdir("/dev/shm") else disk
    config = TieredConfig(
        f"bench-async-{os.getpid()}",
        [
            Tier(f"{shm}/ram", every=1, keep=2),
            Tier(f"{disk}/ssd", every=1, keep=2),
            Tier(f"{disk}/bucket", every=1, keep=2, shared=True, compression="zstd"),
        ],
    )
    try:
        res = Bench(state, config, disk).run(args.runs)
    finally:
        if shutdown(wait=True, timeout=120):  # the writer exited: drop its runtime directory too
            shutil.rmtree(job_dir(config), ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        if shm != disk:
            shutil.rmtree(shm, ignore_errors=True)

    ratios = {
        "tiered_stall_vs_memcpy": res["tiered_stall_s"] / res["memcpy_s"],
        "stock_stall_vs_tiered_stall": res["stock_stall_s"] / res["tiered_stall_s"],
        "tiered_bg_stall_vs_memcpy": res["tiered_bg_stall_s"] / res["memcpy_s"],
    }
    targets = {
        "tiered_stall_vs_memcpy": ("<=", 1.3),
        "stock_stall_vs_tiered_stall": (">=", 2.5),
        "tiered_bg_stall_vs_memcpy": ("<=", 0.1),
    }
    title = f"state: {nbytes / MiB:.0f} MiB in {len(state)} tensors; median of {args.runs} runs (+1 warm-up)"
    met = report(title, nbytes, res, ratios, targets)
    print(
        json.dumps(
            {
                "bench": "async",
                "bytes": nbytes,
                "runs": args.runs,
                "seconds": res,
                "ratios": ratios,
                "targets": {k: f"{op} {x}" for k, (op, x) in targets.items()},
                "met": met,
            }
        )
    )


if __name__ == "__main__":
    main()
