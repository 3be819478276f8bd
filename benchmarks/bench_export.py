"""Exporting a step to safetensors against a stock ``dcp.load`` + ``save_file``, same state.

    .venv/bin/python benchmarks/bench_export.py [--mib 512] [--shard-mib 64] [--runs 3]

A ``--mib`` MiB state (32 float32 tensors under ``model.``) is saved once as step 1 of a
one-tier config on the local disk, and once as a stock ``FileSystemWriter`` directory on the
same disk. Each run then, in a fresh process each (so that peak memory is its own):

- ``stock``: ``dcp.load`` of the whole stock directory (``_EmptyStateDictLoadPlanner``), then
  ``safetensors.torch.save_file`` of it: what a user does without tiered-dcp;
- ``tiered``: ``tiered_dcp.export(..., format="safetensors", only="model",
  max_shard_size=--shard-mib MiB)``.

Reports the median seconds and each process's peak resident memory beyond what it held once
torch was imported (``VmHWM``), as a multiple of the state and of one output file.
Targets: time within 1.5x of stock; memory bounded by one output file plus a fixed
buffer. Prints a table, then JSON. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

MiB = 1 << 20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def hwm_mib() -> float:
    """This process's peak resident memory (``VmHWM``; ``ru_maxrss`` would also count the
    parent's, carried over ``exec``)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def child(kind: str, src: str, dest: str, shard_mib: int) -> None:
    """One export in this process; prints {"seconds", "base_mib", "peak_mib"}."""
    import torch  # noqa: F401
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tiered_dcp import Tier, TieredConfig, export

    warnings.filterwarnings("ignore")
    base = rss_mib()
    t0 = time.perf_counter()
    if kind == "stock":
        state: dict = {}
        reader = dcp.FileSystemReader(src)  # as torch's dcp_to_torch_save reads a whole checkpoint
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        os.makedirs(dest)
        tensors = {k.removeprefix("model."): v for k, v in state["model"].items()}
        save_file(tensors, f"{dest}/model.safetensors")
    else:
        cfg = TieredConfig("bench", [Tier(src)])
        export(cfg, 1, dest, format="safetensors", only="model", max_shard_size=shard_mib * MiB)
    seconds = time.perf_counter() - t0
    peak = hwm_mib()
    print(json.dumps({"seconds": seconds, "base_mib": base, "peak_mib": peak}))


def run_child(kind: str, src: str, dest: str, shard_mib: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, src, dest, str(shard_mib)],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"{kind} export failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--shard-mib", type=int, default=64, help="max_shard_size of the export, MiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--disk", default=tempfile.gettempdir(), help="directory on the local disk")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from common import exit_on_sigterm

    exit_on_sigterm()  # a killed run still removes its directories
    if args.child:
        kind, src, dest, shard = args.child
        child(kind, src, dest, int(shard))
        return

    import torch.distributed.checkpoint as dcp
    from common import make_state, report

    from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown

    warnings.filterwarnings("ignore")
    work = tempfile.mkdtemp(prefix="tdcp-bench-export-", dir=args.disk)
    try:
        state = {"model": make_state(args.mib)}
        nbytes = sum(t.nbytes for t in state["model"].values())
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{work}/stock"))
        dcp.save(state, storage_writer=TieredWriter(TieredConfig("bench", [Tier(f"{work}/tier")]), step=1))
        shutdown()
        del state
        got: dict[str, list[dict]] = {"stock": [], "tiered": []}
        for run in range(args.runs):
            for kind, src in (("stock", f"{work}/stock"), ("tiered", f"{work}/tier")):
                dest = f"{work}/out-{kind}-{run}"
                got[kind].append(run_child(kind, src, dest, args.shard_mib))
                shutil.rmtree(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in got[kind])

    def held(kind: str) -> float:
        return statistics.median(r["peak_mib"] - r["base_mib"] for r in got[kind])

    seconds = {
        "stock_load_and_save_file_s": med("stock", "seconds"),
        "tiered_export_s": med("tiered", "seconds"),
    }
    ratios = {
        "export_time_vs_stock": seconds["tiered_export_s"] / seconds["stock_load_and_save_file_s"],
        "stock_peak_memory_vs_state": held("stock") * MiB / nbytes,
        "export_peak_memory_vs_state": held("tiered") * MiB / nbytes,
        "export_peak_memory_vs_one_file": held("tiered") / args.shard_mib,
    }
    report(
        f"state: {nbytes / MiB:.0f} MiB, safetensors files of <= {args.shard_mib} MiB; "
        f"median of {args.runs} runs (peak memory: beyond the process once torch is imported)",
        nbytes,
        seconds,
        ratios,
        {"export_time_vs_stock": ("<=", 1.5)},
    )
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "shard_mib": args.shard_mib,
                "runs": args.runs,
                "seconds": seconds,
                "ratios": ratios,
                "held_mib": {"stock": held("stock"), "tiered": held("tiered")},
            }
        )
    )


if __name__ == "__main__":
    main()
