"""What the benchmarks share: the state they save, and what a save wrote."""

import atexit
import glob
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from tiered_dcp.cli.local_servers import free_port

MiB = 1 << 20


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``pkill``, a CI job's stop) end this run as an exception would,
    so its ``finally`` blocks remove what it made: a benchmark's RAM tier holds a GiB or more
    of /dev/shm, which outlives a process killed outright."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def own_runtime_dir(prefix: str) -> None:
    """Give the writer processes of this benchmark a runtime directory of their own, unless
    one is set (a rank it started inherits its parent's); this process removes it at exit."""
    if os.environ.get("TIERED_DCP_RUNTIME_DIR"):
        return
    path = tempfile.mkdtemp(prefix=prefix)
    os.environ["TIERED_DCP_RUNTIME_DIR"] = path
    atexit.register(shutil.rmtree, path, True)


def make_state(mib: int, n: int = 32) -> dict:
    """``mib`` MiB of float32 in ``n`` tensors, the same bytes in every run."""
    per = mib * MiB // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def report(title: str, nbytes: int, seconds: dict, ratios: dict, targets: dict) -> dict:
    """Print the seconds table and the ratio table; return which targets are met.

    ``targets`` maps a ratio's name to ``(op, bound)`` with op "<=" or ">="; ratios without
    a target are printed without a verdict.
    """
    met = {k: ratios[k] <= x if op == "<=" else ratios[k] >= x for k, (op, x) in targets.items()}
    print(title)
    print(f"{'measure':<34}{'seconds':>9}{'GB/s':>8}")
    for k, v in seconds.items():
        print(f"{k:<34}{v:>9.3f}{nbytes / v / 1e9:>8.2f}")
    print(f"\n{'ratio':<44}{'value':>7}  {'target':<8}met")
    for k, v in ratios.items():
        op, x = targets.get(k, ("", ""))
        verdict = ("yes" if met[k] else "NO") if k in met else ""
        print(f"{k:<44}{v:>7.2f}  {f'{op} {x}':<8}{verdict}")
    return met


def files(root: str) -> dict[str, tuple[int, int]]:
    """Every file under root: (inode, size), so a rewrite (a new inode) is seen."""
    out = {}
    for f in glob.glob(f"{root}/**", recursive=True):
        if os.path.isfile(f):
            st = os.stat(f)
            out[f] = (st.st_ino, st.st_size)
    return out


def new_bytes(before: dict, after: dict) -> int:
    """Bytes of files that are new or rewritten between two ``files`` listings."""
    return sum(size for name, (ino, size) in after.items() if before.get(name, (None,))[0] != ino)


def _rank_process(
    target: Callable, rank: int, world: int, port: int, env: dict, args: tuple, results: Any
) -> None:
    """One spawned rank: its environment, torch's CPU threads as torchrun sets them, a gloo
    group over the ranks, ``target``, and its value or traceback on ``results``."""
    import datetime
    import traceback
    import warnings

    import torch.distributed as dist

    local = int(env.get("LOCAL_WORLD_SIZE", world))
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local),
        LOCAL_WORLD_SIZE=str(local),
    )
    warnings.filterwarnings("ignore")
    # as torchrun does with several processes per node: one thread each for torch's CPU ops,
    # unless OMP_NUM_THREADS says otherwise (set here, after torch was imported, it would not
    # take). Left at every core, 4 ranks' copies on 2 cores spin against each other: NvRx's
    # copy of its loaded tensors took 200+ ms instead of a few (bench_nvrx)
    threads = int(os.environ.get("OMP_NUM_THREADS") or (1 if local > 1 else 0))
    if threads:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        value = target(rank, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def spawn_ranks(
    target: Callable, world: int, *args: Any, env: dict | None = None, timeout: float = 900
) -> dict[int, Any]:
    """``target(rank, *args)`` on ``world`` spawned processes joined by a gloo group (``env``
    added to each one's environment; ``LOCAL_WORLD_SIZE`` there lays out the nodes, and
    ``LOCAL_RANK`` follows from it). Every rank's value; the first failing rank's
    traceback is raised."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_process, args=(target, r, world, port, env or {}, args, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, kind, value = results.get(timeout=timeout)
            if kind != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def slowest(seconds: float) -> float:
    """The slowest rank's ``seconds`` (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
