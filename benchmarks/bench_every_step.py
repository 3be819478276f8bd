"""A save every step, on the host: how fast the host side commits what ``async_save`` staged,
one rank alone and with each part replicated to a peer on another node (issue 49's CPU part).

    .venv/bin/python benchmarks/bench_every_step.py [--mib 1024] [--saves 8] [--tensors 8]

Each case runs in fresh processes (``common.spawn_ranks``, gloo, one torch thread per rank as
torchrun sets it): ``--saves`` ``dcp.async_save`` calls back to back of a ``--mib`` MiB state
per rank, each once the future of the one before is done and the state has changed (a
training step that does nothing else), to a RAM tier ``keep=2`` alone (no writer process).
Per save, on the slowest rank:

- ``stall``: until ``async_save`` returns (the copy the training loop waits for);
- ``host``: from its return until its future is done: the checksums and the non-finite
  screen, the replica sent to the peer and the peer's received and checked, the commit;
- ``memcpy``: a copy of the same state into preallocated tensors, just before the save (the
  machine's noise of the moment in both);
- ``cpu``: the process's CPU time over ``host`` (every thread's), for GB/s per core.

Cases: ``single`` (one rank) and ``replicated`` (2 ranks as 2 nodes, ``LOCAL_WORLD_SIZE=1``,
``replication_factor=2``: every part also lands in the peer's RAM tier). Figures are medians
over the saves from the 3rd (the RAM tier's part files recycled by then). After the loop each
rank loads the last ``keep`` steps back and checks them exact. Prints a table, then JSON.
Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import MiB, make_state, slowest, spawn_ranks

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown

warnings.filterwarnings("ignore")
TARGETS = {"single_host_vs_memcpy": ("<=", 1.5), "replicated_rate_vs_single": (">=", 0.5)}  # issue 49


def value(step: int, i: int) -> float:
    return step + i / 8


def one_rank(rank: int, root: str, mib: int, saves: int, tensors: int, replicated: bool) -> dict:
    import logging

    logging.getLogger("tiered_dcp").setLevel(logging.ERROR)
    state = {f"r{rank}.{k}": v for k, v in make_state(mib, tensors).items()}
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    cfg = TieredConfig(
        "every",
        [Tier(f"{root}/ram/{{node}}", keep=2)],
        replication_factor=2 if replicated else 1,
        replication_jump=1,
    )
    group = dist.new_group(backend="gloo")  # the saves' own: async collectives off the default
    rows = []
    fut = None
    for step in range(1, saves + 1):
        for i, v in enumerate(state.values()):
            v.fill_(value(step, i))  # every byte changes, and each step's state can be told again
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        memcpy = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step), process_group=group)
        t1, c1 = time.perf_counter(), time.process_time()
        fut.result()
        t2, c2 = time.perf_counter(), time.process_time()
        rows.append({"stall": slowest(t1 - t0), "host": slowest(t2 - t1), "cpu": c2 - c1, "memcpy": memcpy})
    exact = []
    for step in (saves - 1, saves):  # the steps the RAM tier keeps
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(target, storage_reader=TieredReader(cfg, step=step), process_group=group)
        exact.append(all(bool((t == value(step, i)).all()) for i, t in enumerate(target.values())))
    shutdown(wait=True, timeout=60)
    return {"rows": rows, "exact": all(exact)}


def case(replicated: bool, args: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix="tdcp-bench-every-", dir="/dev/shm")
    env = {"LOCAL_WORLD_SIZE": 1, "TIERED_DCP_RUNTIME_DIR": f"{root}/runtime"}
    try:
        world = 2 if replicated else 1
        out = spawn_ranks(one_rank, world, root, args.mib, args.saves, args.tensors, replicated, env=env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = out[0]["rows"][2:]
    nbytes = args.mib * MiB
    host = statistics.median(r["host"] for r in rows)
    cpu = statistics.median(r["cpu"] for r in rows)
    return {
        "stall_s": statistics.median(r["stall"] for r in rows),
        "host_s": host,
        "memcpy_s": statistics.median(r["memcpy"] for r in rows),
        "host_vs_memcpy": statistics.median(r["host"] / r["memcpy"] for r in rows),
        "host_gb_s": nbytes / host / 1e9,
        "host_cpu_s": cpu,
        "host_gb_per_cpu_s": nbytes / cpu / 1e9 if cpu else float("nan"),
        "exact": all(o["exact"] for o in out.values()),
        "hosts": [round(r["host"], 3) for r in out[0]["rows"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="state per rank in MiB (default 1024)")
    ap.add_argument("--saves", type=int, default=8, help="saves back to back per case (default 8)")
    ap.add_argument("--tensors", type=int, default=8, help="tensors in the state (default 8)")
    ap.add_argument("--single-only", action="store_true", help="the single-rank case alone")
    args = ap.parse_args()
    single = case(False, args)
    if args.single_only:
        print(json.dumps({"bench": "every-step", "single": single}))
        return
    replicated = case(True, args)
    ratios = {
        "single_host_vs_memcpy": single["host_vs_memcpy"],
        "replicated_host_vs_memcpy": replicated["host_vs_memcpy"],
        "replicated_rate_vs_single": replicated["host_gb_s"] / single["host_gb_s"],
    }
    print(
        f"{args.mib} MiB per rank in {args.tensors} tensors, {args.saves} saves back to back (from the 3rd)"
    )
    print(f"{'case':<12}{'stall s':>9}{'host s':>9}{'memcpy s':>10}{'host GB/s':>11}{'GB/CPU-s':>10}  exact")
    for name, c in (("single", single), ("replicated", replicated)):
        print(
            f"{name:<12}{c['stall_s']:>9.3f}{c['host_s']:>9.3f}{c['memcpy_s']:>10.3f}"
            f"{c['host_gb_s']:>11.2f}{c['host_gb_per_cpu_s']:>10.2f}  {c['exact']}"
        )
    for k, v in ratios.items():
        op, bound = TARGETS.get(k, ("", ""))
        verdict = "" if not op else ("met" if (v <= bound if op == "<=" else v >= bound) else "NOT met")
        print(f"{k:<28}{v:>7.2f}  {op} {bound} {verdict}")
    print(json.dumps({"bench": "every-step", "single": single, "replicated": replicated, "ratios": ratios}))


if __name__ == "__main__":
    main()
