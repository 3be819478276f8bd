"""A save every step, on the host: how fast the host side commits what ``async_save`` staged,
one rank alone and with each part replicated to a peer on another node (the CPU part).

    .venv/bin/python benchmarks/bench_every_step.py [--mib 1024] [--saves 8] [--tensors 8]
        [--cases single,replicated,stock]

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
- ``cpu``: the process's CPU time over ``host`` (every thread's), for GB/s per core;
- ``peak/state``: the most host memory the checkpoints held on the fullest node over the
  loop (``Peak``: the tier's files, spares, replicas and prepared files, each once, and the
  staging beyond them), in states: ``keep + 1`` = 3 for one rank; a node holding its peer's replicas too
  holds ``2 * keep + 1``.

Cases: ``single`` (one rank), ``replicated`` (2 ranks as 2 nodes, ``LOCAL_WORLD_SIZE=1``,
``replication_factor=2``: every part also lands in the peer's RAM tier) and ``stock`` (one
rank, torch's ``FileSystemWriter`` into a directory per step on /dev/shm, its own staging as
its users get it; the steps before the last two deleted between saves, untimed). The state
is nested (``{"model": {...}}``) as a trainer's is; ``--tensors 1000 --mib 64`` shows what
each tensor costs a save beside what each byte does. Figures are medians
over the saves from the 3rd (the RAM tier's part files recycled by then). After the loop each
rank loads the last ``keep`` steps back and checks them exact. Prints a table, then JSON.
Never fails on timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import MiB, exit_on_sigterm, make_state, slowest, spawn_ranks
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown
from tiered_dcp.save.staging import POOL

warnings.filterwarnings("ignore")
TARGETS = {"single_host_vs_memcpy": ("<=", 1.5), "replicated_rate_vs_single": (">=", 0.5)}


def value(step: int, i: int) -> float:
    return step + i / 8


class Peak:
    """The most host memory the checkpoints held while running: every file under ``where``
    (the RAM tier's steps, spares, a replica; or stock's directories) and every file there
    this process holds open with no name (part files prepared for the next saves), each
    inode once, plus this process's staging buffers beyond them (a first copy in private
    memory), sampled every 5 ms on a thread of its own."""

    def __init__(self, where: str) -> None:
        self.where, self.most, self._stop = where, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def held(self) -> int:
        paths = [os.path.join(d, n) for d, _, names in os.walk(self.where) for n in names]
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(self.where):
                    paths.append(f"/proc/self/fd/{fd}")
        blocks = {}
        for path in paths:
            with contextlib.suppress(OSError):  # renamed or retired as it is listed
                st = os.stat(path)
                blocks[st.st_ino] = st.st_blocks * 512
        return sum(blocks.values()) + POOL.info()["bytes"]

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.most = max(self.most, self.held())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


def one_rank(rank: int, root: str, mib: int, saves: int, tensors: int, how: str) -> dict:
    import logging

    logging.getLogger("tiered_dcp").setLevel(logging.ERROR)
    model = {f"r{rank}.{k}": v for k, v in make_state(mib, tensors).items()}
    state = {"model": model}  # nested, as a trainer's (torch's async_save wraps each top-level value)
    dst = {k: torch.empty_like(v) for k, v in model.items()}
    cfg = TieredConfig(
        "every",
        [Tier(f"{root}/ram/{{node}}", keep=2)],
        replication_factor=2 if how == "replicated" else 1,
        replication_jump=1,
    )
    group = dist.new_group(backend="gloo")  # the saves' own: async collectives off the default
    rows = []
    peak = Peak(f"{root}/stock" if how == "stock" else f"{root}/ram/{rank}")  # this rank's node
    for step in range(1, saves + 1):
        for i, v in enumerate(model.values()):
            v.fill_(value(step, i))  # every byte changes, and each step's state can be told again
        t0 = time.perf_counter()
        for k, v in model.items():
            dst[k].copy_(v)
        memcpy = time.perf_counter() - t0
        if how == "stock":  # its own directory per step, the RAM tier's keep=2 by hand (untimed)
            shutil.rmtree(f"{root}/stock/{step - 2}", ignore_errors=True)
            writer = FileSystemWriter(f"{root}/stock/{step}")
        else:
            writer = TieredWriter(cfg, step=step)
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer, process_group=group)
        t1, c1 = time.perf_counter(), time.process_time()
        fut.result()
        t2, c2 = time.perf_counter(), time.process_time()
        rows.append({"stall": slowest(t1 - t0), "host": slowest(t2 - t1), "cpu": c2 - c1, "memcpy": memcpy})
    most = peak.stop()
    exact = []
    for step in (saves - 1, saves):  # the steps the RAM tier keeps
        target = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
        reader = FileSystemReader(f"{root}/stock/{step}") if how == "stock" else TieredReader(cfg, step=step)
        dcp.load(target, storage_reader=reader, process_group=group)
        got = target["model"].values()
        exact.append(all(bool((t == value(step, i)).all()) for i, t in enumerate(got)))
    shutdown(wait=True, timeout=60)
    state_bytes = sum(v.numel() * v.element_size() for v in model.values())
    return {"rows": rows, "exact": all(exact), "peak_vs_state": most / state_bytes}


def case(how: str, args: argparse.Namespace) -> dict:
    root = tempfile.mkdtemp(prefix="tdcp-bench-every-", dir="/dev/shm")
    env = {"LOCAL_WORLD_SIZE": 1, "TIERED_DCP_RUNTIME_DIR": f"{root}/runtime"}
    try:
        world = 2 if how == "replicated" else 1
        out = spawn_ranks(one_rank, world, root, args.mib, args.saves, args.tensors, how, env=env)
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
        # the fullest node; stock's staging is memory of its own, not seen by ``Peak``: not shown
        "peak_vs_state": None if how == "stock" else max(o["peak_vs_state"] for o in out.values()),
        "hosts": [round(r["host"], 3) for r in out[0]["rows"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="state per rank in MiB (default 1024)")
    ap.add_argument("--saves", type=int, default=8, help="saves back to back per case (default 8)")
    ap.add_argument("--tensors", type=int, default=8, help="tensors in the state (default 8)")
    ap.add_argument(
        "--cases", default="single,replicated,stock", help="of single, replicated, stock (default all)"
    )
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    unknown = set(args.cases.split(",")) - {"single", "replicated", "stock"}
    if unknown:
        ap.error(f"--cases: {sorted(unknown)} unknown; give some of single,replicated,stock")
    cases = {how: case(how, args) for how in args.cases.split(",")}
    single, replicated = cases.get("single"), cases.get("replicated")
    ratios = {}
    if single:
        ratios["single_host_vs_memcpy"] = single["host_vs_memcpy"]
    if replicated:
        ratios["replicated_host_vs_memcpy"] = replicated["host_vs_memcpy"]
    if single and replicated:
        ratios["replicated_rate_vs_single"] = replicated["host_gb_s"] / single["host_gb_s"]
    if single and "stock" in cases:
        ratios["single_host_vs_stock_host"] = single["host_s"] / cases["stock"]["host_s"]
    print(
        f"{args.mib} MiB per rank in {args.tensors} tensors, {args.saves} saves back to back (from the 3rd)"
    )
    print(
        f"{'case':<12}{'stall s':>9}{'host s':>9}{'memcpy s':>10}{'host GB/s':>11}{'GB/CPU-s':>10}"
        f"{'peak/state':>11}  exact"
    )
    for name, c in cases.items():
        print(
            f"{name:<12}{c['stall_s']:>9.3f}{c['host_s']:>9.3f}{c['memcpy_s']:>10.3f}"
            f"{c['host_gb_s']:>11.2f}{c['host_gb_per_cpu_s']:>10.2f}"
            f"{'-' if c['peak_vs_state'] is None else format(c['peak_vs_state'], '.2f'):>11}  {c['exact']}"
        )
    for k, v in ratios.items():
        op, bound = TARGETS.get(k, ("", ""))
        verdict = "" if not op else ("met" if (v <= bound if op == "<=" else v >= bound) else "NOT met")
        print(f"{k:<28}{v:>7.2f}  {op} {bound} {verdict}")
    print(json.dumps({"bench": "every-step", **cases, "ratios": ratios}))


if __name__ == "__main__":
    main()
