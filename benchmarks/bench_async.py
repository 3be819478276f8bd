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

``--series`` measures instead the stall series, each case in a fresh trainer
subprocess (so that its first save is the process's first) sampled for host memory as
``bench_memory`` samples it: ``--saves`` async saves back to back (each starts as soon as
the future of the one before it is done) of ``--mib`` MiB in ``--tensors`` tensors, to a
RAM tier keep=2 and a disk tier every=2 keep=2; every save's stall, the warm memcpy of the
state in the same process, stock DCP's first stall (a fresh process too), and the peak
host memory as a multiple of the state (also for ``--mem-mib``). ``--prepare`` calls
``TieredWriter.prepare`` before the first save. The trainer copies the state once more
just before each save (the memcpy it is compared to: on a shared machine the noise of the
moment is in both); the ratios are per save, against that copy.
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
from bench_memory import anon, tree  # noqa: E402
from common import MiB, exit_on_sigterm, make_state, report  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown, wait_for, writer_status
from tiered_dcp.writer_process.run_dir import job_dir

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


def series_child(args: argparse.Namespace) -> None:
    """One trainer: the memcpy, then ``--saves`` async saves back to back; JSON on stdout."""
    import logging

    from tiered_dcp.save import host_memory
    from tiered_dcp.writer_process.client import writer_handle

    logging.getLogger("tiered_dcp").setLevel(logging.ERROR)
    state = make_state(args.mib, args.tensors)
    work, shm = args.work, args.shm
    tiers = [Tier(f"{shm}/ram", every=1, keep=2), Tier(f"{work}/ssd", every=2, keep=2)]
    # "skip": the disk tier takes the steps it can; no save waits for it (the stall series' setting)
    config = TieredConfig(
        f"bench-series-{os.getpid()}", tiers[:1] if args.ram_only else tiers, on_lagging_tier="skip"
    )
    dst = {k: torch.empty_like(v) for k, v in state.items()}  # counted in the baseline

    def memcpy() -> float:
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        return time.perf_counter() - t0

    copies = [memcpy() for _ in range(3)]
    host_memory._GUARDED.clear()
    open(os.path.join(work, "ready"), "w").close()
    time.sleep(0.2)  # the sampler takes its baseline
    stalls: list[float] = []
    fut = None
    try:
        if args.child == "stock":
            copies.append(memcpy())
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(f"{shm}/stock"))
            stalls.append(time.perf_counter() - t0)
            fut.result()
        else:
            if args.prepare:
                TieredWriter(config, step=1).prepare(state)
            for step in range(1, args.saves + 1):
                for v in state.values():
                    v.add_(1.0)  # a training step
                if fut is not None:
                    fut.result()
                # the same copy just before the save (the same machine noise), and as the save
                # copies: its writer process paused meanwhile (``run_dir.StagingLock``)
                with writer_handle(config, 0).rd.writer.staging.hold():
                    copies.append(memcpy())
                writer = TieredWriter(config, step=step)
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=writer)
                stalls.append(time.perf_counter() - t0)
            fut.result()
        adjacent = copies[3:]
        out = {"memcpy": statistics.median(copies[1:]), "stalls": stalls, "adjacent": adjacent}
        print("SERIES " + json.dumps(out), flush=True)
    finally:
        shutdown(wait=True, timeout=120)
        shutil.rmtree(job_dir(config), ignore_errors=True)


def shm_held(root: str, pids: list[int]) -> int:
    """The /dev/shm bytes a case holds: the files under its own directory, and the files in
    /dev/shm its processes hold open with no name (prepared part files, torch's shared
    memory), each inode once. Other users of /dev/shm on the machine do not count."""
    seen: dict[tuple[int, int], int] = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"):
                    continue
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def anon_of(pids: list[int]) -> int:
    """The anonymous memory (``RssAnon``) of the trainer ``pids[0]`` and the processes under
    it, less any still running the trainer's own command: a writer process forked from the
    trainer and caught before its exec shares the trainer's pages copy-on-write, and would
    count them a second time (+2.3x the state). Cheap to read (no page-table walk, unlike
    ``Pss_Anon``, whose sampling every 5 ms slowed the trainer's copies)."""
    own = cmdline(pids[0])
    return sum(anon(p) for p in pids if p == pids[0] or cmdline(p) != own)


def series_case(case: str, args: argparse.Namespace, mib: int) -> dict:
    """Run one trainer subprocess, sampling its host memory: its processes' anonymous memory
    (``anon_of``) plus what it holds in /dev/shm (``shm_held``)."""
    import subprocess
    import sys

    work = tempfile.mkdtemp(prefix="tdcp-bench-series-")
    shm = tempfile.mkdtemp(prefix="tdcp-bench-series-", dir="/dev/shm")
    cmd = [sys.executable, __file__, "--child", case, "--mib", str(mib), "--tensors", str(args.tensors)]
    cmd += ["--saves", str(args.saves), "--work", work, "--shm", shm]
    cmd += (["--prepare"] if args.prepare else []) + (["--ram-only"] if args.ram_only else [])
    with open(os.path.join(work, "out.log"), "w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        peak, base = 0, None
        while proc.poll() is None:
            pids = tree(proc.pid)
            if base is None and os.path.exists(os.path.join(work, "ready")):
                base = anon(proc.pid) + shm_held(shm, pids)
            if base is not None:
                peak = max(peak, shm_held(shm, pids) + anon_of(pids) - base)
            time.sleep(0.005)
        log.seek(0)
        out = log.read()
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    lines = [ln for ln in out.splitlines() if ln.startswith("SERIES ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"case {case} failed ({proc.returncode}): {out[-3000:]}")
    res = json.loads(lines[-1][len("SERIES ") :])
    res["peak"] = peak / (mib * MiB)
    return res


def series(args: argparse.Namespace) -> None:
    """The stall series' figures, medians over ``--runs`` runs of each case."""
    runs = []
    for _ in range(args.runs):
        stock = series_case("stock", args, args.mib)
        tiered = series_case("tiered", args, args.mib)
        mem = series_case("tiered", args, args.mem_mib)
        m = tiered["memcpy"]
        st = tiered["stalls"]
        x = [s / c for s, c in zip(st, tiered["adjacent"], strict=True)]  # each vs the memcpy just before it
        runs.append(
            {
                "memcpy_s": m,
                "stock_first_s": stock["stalls"][0],
                "first_s": st[0],
                "saves_2_3_max_x": max(x[1:3]),
                "steady_max_x": max(x[3:]),
                "from_2nd_max_x": max(x[1:]),
                "from_2nd_median_x": statistics.median(x[1:]),
                "from_2nd_median_x_vs_median_memcpy": statistics.median(st[1:]) / m,
                "first_vs_stock_first": st[0] / stock["stalls"][0],
                "peak_x": tiered["peak"],
                f"peak_x_{args.mem_mib}mib": mem["peak"],
                "stalls_x": [round(r, 2) for r in x],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "stalls_x"}
    targets = {
        "from_2nd_max_x": ("<=", 1.5),
        "from_2nd_median_x": ("<=", 1.15),
        "first_vs_stock_first": ("<=", 1.0),
        f"peak_x_{args.mem_mib}mib": ("<=", 3.1),
    }
    print(f"\n{args.mib} MiB in {args.tensors} tensors, {args.saves} saves back to back, {args.runs} runs")
    for k, v in med.items():
        op, x = targets.get(k, ("", ""))
        verdict = "" if k not in targets else ("yes" if (v <= x) else "NO")
        print(f"{k:<28}{v:>9.3f}  {f'{op} {x}':<8}{verdict}")
    print(json.dumps({"bench": "async-series", "runs": runs, "medians": med}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", action="store_true", help="the stall series' figures (see the docstring)")
    ap.add_argument("--saves", type=int, default=10, help="--series: saves per run (default 10)")
    ap.add_argument("--mem-mib", type=int, default=1024, help="--series: state of the memory run")
    ap.add_argument("--prepare", action="store_true", help="--series: TieredWriter.prepare first")
    ap.add_argument("--ram-only", action="store_true", help="--series: no disk tier (what its writer costs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    ap.add_argument(
        "--runs", type=int, default=5, help="runs per mode after one warm-up; the median is reported"
    )
    ap.add_argument("--tensors", type=int, default=32, help="number of tensors (default 32)")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    if args.child:
        return series_child(args)
    if args.series:
        return series(args)
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
