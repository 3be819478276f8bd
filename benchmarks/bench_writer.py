"""The writer process: its memory and how soon after it starts a step reaches the slower tiers.

    .venv/bin/python benchmarks/bench_writer.py [--mib 16] [--runs 3]

A real small job: one trainer saves a ``--mib`` MiB state with ``dcp.save`` to three tiers
(RAM on /dev/shm, an SSD directory, a zstd "bucket" directory declared shared). The save
starts the rank's writer process, which copies the step to the two slower tiers. Per run,
with a fresh writer each time:

- RSS of the writer (VmRSS, and its peak VmHWM) read from /proc once the step is committed
  on every tier, and whether it maps any torch library;
- the time from the writer process's start (/proc/PID/stat, 10 ms resolution) to its
  being ready (its pid file written, imports done) and to the step's commit on each
  slower tier (the marker's ``created`` time, via ``status``), and from the step's commit
  on RAM to it (the copy itself, polling included).

Medians of ``--runs`` runs; prints a table, then JSON. Never fails on the figures.
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
from common import MiB, exit_on_sigterm, make_state, own_runtime_dir

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown, status, wait_for, writer_status
from tiered_dcp.writer_process.run_dir import RunDir

warnings.filterwarnings("ignore")
TARGETS = {"rss_mb": 100.0, "first_step_s": 1.0}  # the design's targets for the writer process


def started_at(pid: int, now: float) -> float:
    """When ``pid`` started, on the time.time() clock (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return now - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def memory_mb(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any("/torch/" in line or "libtorch" in line for line in f)


def one_run(run: int, state: dict, shm: str, disk: str) -> dict:
    cfg = TieredConfig(
        f"benchw{run}",
        [
            Tier(f"{shm}/ram", keep=2),
            Tier(f"{disk}/ssd", keep=2),
            Tier(f"{disk}/bucket", keep=2, compression="zstd", shared=True),
        ],
    )
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    wait_for(cfg, 1, timeout=120)
    now = time.time()
    (w,) = writer_status(cfg)
    assert w.pid is not None and w.running, "the writer exited before it could be measured"
    mem = memory_mb(w.pid)
    start = started_at(w.pid, now)
    created = {r.tier_index: r.created for r in status(cfg) if r.step == 1 and r.state == "committed"}
    ready = os.stat(RunDir.of(cfg, 0).writer.pid_path).st_mtime  # written once its imports are done
    res = {
        "rss_mb": mem["VmRSS"],
        "hwm_mb": mem["VmHWM"],
        "maps_torch": maps_torch(w.pid),
        "writer_ready_after_start_s": ready - start,
        "ram_commit_after_writer_start_s": created[0] - start,
    }
    for tier, name in ((1, "ssd"), (2, "bucket")):
        res[f"{name}_first_step_after_writer_start_s"] = created[tier] - start
        res[f"{name}_after_ram_commit_s"] = created[tier] - created[0]
    shutdown(wait=True, timeout=60)  # the writer exits; the next run starts a fresh one
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16, help="state size in MiB (default 16)")
    ap.add_argument("--runs", type=int, default=3, help="runs (fresh writers); medians are reported")
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="directory on the local disk")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    own_runtime_dir("tdcp-benchw-rt-")
    state = make_state(args.mib)
    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else args.disk
    shm = tempfile.mkdtemp(prefix="tdcp-benchw-", dir=shm_base)
    disk = tempfile.mkdtemp(prefix="tdcp-benchw-", dir=args.disk)
    try:
        runs = [one_run(i, state, shm, disk) for i in range(args.runs)]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "maps_torch"}
    torch_mapped = any(r["maps_torch"] for r in runs)
    rows = [
        ("writer RSS after the first step (VmRSS), MiB", med["rss_mb"], f"<= {TARGETS['rss_mb']:.0f}"),
        ("writer peak RSS (VmHWM), MiB", med["hwm_mb"], ""),
        ("writer ready (imports done), s after its start", med["writer_ready_after_start_s"], ""),
        ("RAM commit, s after the writer started", med["ram_commit_after_writer_start_s"], ""),
    ]
    for name in ("ssd", "bucket"):
        first = med[f"{name}_first_step_after_writer_start_s"]
        target = f"< {TARGETS['first_step_s']:.0f}"
        rows.append((f"{name}: step committed, s after writer start", first, target))
        rows.append((f"{name}: step committed, s after RAM commit", med[f"{name}_after_ram_commit_s"], ""))
    met = {
        "rss_mb": med["rss_mb"] <= TARGETS["rss_mb"],
        "first_step_s": all(
            med[f"{n}_first_step_after_writer_start_s"] < TARGETS["first_step_s"] for n in ("ssd", "bucket")
        ),
        "no_torch": not torch_mapped,
    }
    print(f"writer process: {args.mib} MiB state, tiers RAM, SSD, zstd bucket; median of {args.runs} runs")
    print(f"{'measure':<50}{'value':>9}  target")
    for label, value, target in rows:
        print(f"{label:<50}{value:>9.3f}  {target}")
    print(f"{'torch libraries mapped by the writer':<50}{'yes' if torch_mapped else 'no':>9}  no")
    print("targets met: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in met.items()))
    print(json.dumps({"bytes": args.mib * MiB, "runs": runs, "median": med, "met": met}))


if __name__ == "__main__":
    main()
