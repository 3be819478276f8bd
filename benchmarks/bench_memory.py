"""Peak host memory of async saves, against stock DCP in the same run.

    .venv/bin/python benchmarks/bench_memory.py [--mib 1024] [--saves 6] [--runs 1]

One trainer process (a subprocess of this script per case) saves a ``--mib`` MiB float32
state ``--saves`` times with ``dcp.async_save``, every value changed before each save; a
save waits for the future of the one before it, as torch's async recipe does
(``--step-seconds``, 0.05 by default, of training between saves: the writer process copies
the SSD tier's steps meanwhile, and a RAM-tier step it still copies is pinned there, held
beside the kept ones; ``--inflight 2`` lets a save start while the one before it uploads; DCP's PROCESS mode
garbles its pipe with two in flight, so its cases keep one). Sampled every 5 ms: the shared memory
in use (``/dev/shm``'s used bytes: tier files and staging buffers alike) plus the
anonymous memory (``RssAnon``) of the trainer and every process under it (the writer
process, DCP's background process), less the trainer's own before its first save (the
live state). The peak is reported as a multiple of the state. Cases:

- ``tiered``: a RAM tier in /dev/shm keep=2 and an SSD tier (a temp dir on disk) every=2
  keep=2 (``--ssd-every``);
- ``stock``: ``FileSystemWriter`` into /dev/shm, one directory per step, the older ones
  deleted past the newest 2 (keep=2 by hand);
- ``tiered-process``, ``stock-process``: both again in DCP's PROCESS async mode
  (``--process-mib``, 512 MiB by default);
- ``tiered-frozen-dedup``: half the tensors never change, ``dedup=True``;
- ``tiered-no-ram``: the SSD tier alone.

``net`` is the peak less DCP's own background process (PROCESS mode: its interpreter and
torch, not the storage layer's). The floor without dedup is the kept steps plus the one
being written: 3.0x. Prints a table, then JSON. Never fails on a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20
SHM = "/dev/shm"


def shm_used() -> int:
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it (the writer keeps its parent until the trainer ends)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def is_dcp_process(pid: int) -> bool:
    """DCP's own background process of the PROCESS async mode (a multiprocessing child)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing" in f.read()
    except OSError:
        return False


def measure(
    case: str, mib: int, saves: int, mode: str, inflight: int, step_s: float = 0.05, ssd_every: int = 2
) -> dict:
    """Run one case in a trainer subprocess and sample its memory until it ends."""
    work = tempfile.mkdtemp(prefix="bench-memory-")
    ready = os.path.join(work, "ready")
    cmd = [sys.executable, __file__, "--child", case, "--mib", str(mib), "--saves", str(saves)]
    cmd += ["--mode", mode, "--work", work, "--inflight", str(inflight if mode == "thread" else 1)]
    cmd += ["--step-seconds", str(step_s), "--ssd-every", str(ssd_every)]
    base_shm = shm_used()
    log = open(os.path.join(work, "out.log"), "w+")  # noqa: SIM115  (a file: a pipe left full would block)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    peak, base_anon = 0, None
    peak_parts = (0, 0)
    net = 0  # the peak less DCP's background process (PROCESS mode): what the storage layer holds
    while proc.poll() is None:
        if base_anon is None and os.path.exists(ready):
            base_anon = anon(proc.pid)
        if base_anon is not None:
            s = shm_used() - base_shm
            pids = tree(proc.pid)
            a = sum(anon(p) for p in pids) - base_anon
            if s + a > peak:
                peak, peak_parts = s + a, (s, a)
            net = max(net, s + a - sum(anon(p) for p in pids if is_dcp_process(p)))
        time.sleep(0.005)
    log.seek(0)
    out = log.read()[-3000:]
    log.close()
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(f"case {case} failed ({proc.returncode}): {out}")
    state = mib * MiB
    return {
        "peak": peak / state,
        "shm": peak_parts[0] / state,
        "anon": peak_parts[1] / state,
        "net": net / state,
    }


def child(args: argparse.Namespace) -> None:
    """The trainer: build the state, then ``--saves`` async saves (at most two in flight)."""
    import logging
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from tiered_dcp import Tier, TieredConfig, TieredWriter, shutdown
    from tiered_dcp.cli.local_servers import free_port

    warnings.filterwarnings("ignore")
    logging.getLogger("tiered_dcp").setLevel(logging.ERROR)
    port = free_port()  # DCP's PROCESS mode needs a process group: one of one rank
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    n = 16
    state = {f"w{i}": torch.randn(args.mib * MiB // n // 4) for i in range(n)}
    frozen = set(list(state)[: n // 2]) if "frozen" in args.child else set()
    shm_dir = tempfile.mkdtemp(prefix="bench-memory-", dir=SHM)
    ssd = os.path.join(args.work, "ssd")
    kind = AsyncCheckpointerType.PROCESS if args.mode == "process" else AsyncCheckpointerType.THREAD
    tiers = [Tier(f"{shm_dir}/ram", keep=2), Tier(ssd, every=args.ssd_every, keep=2)]
    if args.child == "tiered-no-ram":
        tiers = [Tier(ssd, keep=2)]
    cfg = TieredConfig("mem", tiers, dedup="dedup" in args.child)
    open(os.path.join(args.work, "ready"), "w").close()
    time.sleep(0.1)  # the sampler takes its baseline
    futures: list = []
    done: list[int] = []
    try:
        for step in range(1, args.saves + 1):
            for k, v in state.items():
                if k not in frozen:
                    v.add_(1.0)
            if len(futures) == args.inflight:  # torch's recipe: the previous save's future first
                futures.pop(0).result()
            if args.child.startswith("stock"):
                writer = dcp.FileSystemWriter(f"{shm_dir}/step_{step}")
                done.append(step)
                for old in done[:-3]:  # the two kept, and the one being written
                    shutil.rmtree(f"{shm_dir}/step_{old}", ignore_errors=True)
            else:
                writer = TieredWriter(cfg, step=step)
            futures.append(dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind))
            time.sleep(args.step_seconds)  # a training step
        for f in futures:
            f.result()
        if args.child.startswith("stock"):
            for old in done[:-2]:
                shutil.rmtree(f"{shm_dir}/step_{old}", ignore_errors=True)
        time.sleep(0.2)
        shutdown()
        torch.distributed.destroy_process_group()
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


CASES = {  # name: DCP's async mode
    "tiered": "thread",
    "stock": "thread",
    "tiered-process": "process",
    "stock-process": "process",
    "tiered-frozen-dedup": "thread",
    "tiered-no-ram": "thread",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--process-mib", type=int, default=512)
    ap.add_argument("--saves", type=int, default=6)
    ap.add_argument("--inflight", type=int, default=1, help="async saves in flight at most")
    ap.add_argument(
        "--step-seconds",
        type=float,
        default=0.05,
        help="training time between saves (the writer copies meanwhile)",
    )
    ap.add_argument("--ssd-every", type=int, default=2, help="the SSD tier's every (default 2)")
    ap.add_argument("--runs", type=int, default=1, help="runs per case; the median peak is reported")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="thread", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from common import exit_on_sigterm

    exit_on_sigterm()  # a killed run still removes its directories
    if args.child:
        return child(args)
    out = {}
    for case in [c.strip() for c in args.cases.split(",")]:
        mode = CASES[case]
        mib = args.process_mib if mode == "process" else args.mib
        runs = [
            measure(case, mib, args.saves, mode, args.inflight, args.step_seconds, args.ssd_every)
            for _ in range(args.runs)
        ]
        runs.sort(key=lambda r: r["peak"])
        out[case] = {"mib": mib, **runs[len(runs) // 2]}
    print(
        f"peak host memory of {args.saves} async saves ({args.inflight} in flight), "
        f"as multiples of the state (medians of {args.runs})"
    )
    print(f"{'case':<30}{'MiB':>6}{'peak':>8}{'shared':>8}{'anon':>8}{'net':>8}")
    for case, r in out.items():
        row = f"{r['peak']:>7.2f}x{r['shm']:>7.2f}x{r['anon']:>7.2f}x{r['net']:>7.2f}x"
        print(f"{case:<30}{r['mib']:>6}{row}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
