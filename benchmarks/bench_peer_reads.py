"""What the peer phase of a load costs: intact, and after a node loss.

    .venv/bin/python benchmarks/bench_peer_reads.py [--loads 20] [--mib 4]

Four real processes on gloo (torch.multiprocessing spawn) play two nodes
(LOCAL_WORLD_SIZE=2: ranks 0-1 on node 0, ranks 2-3 on node 1), replication 2/2 on one
node-local RAM tier under /dev/shm, each rank saving its own ``--mib`` MiB. One step is
saved, then loaded ``--loads`` times with every root intact and ``--loads`` times after
node 1's root is deleted. Timed is ``reading.StepReads._read_from_peers`` alone (the peer
phase: agreeing on the wish lists and moving the items), the slowest rank's time per load
(all_reduce MAX); printed is the median, the minimum and the maximum over the loads, after
one discarded warm-up load of each kind, and the groups this phase opened per load. Also
printed: the job store's key count after each kind of load (it must not grow from load
to load). Never fails on timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from bench_replication import free_port
from common import make_state

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, transport
from tiered_dcp.reading import StepReads

WORLD = 4
RANKS_PER_NODE = 2


class TimedReads(StepReads):
    """A load plan's execution that keeps how long its peer phase took on this rank."""

    peer_s = 0.0

    def _read_from_peers(self, pending: list, planner: Any, routes: dict) -> list:
        t0 = time.perf_counter()
        try:
            return super()._read_from_peers(pending, planner, routes)
        finally:
            self.peer_s = time.perf_counter() - t0


class TimedReader(TieredReader):
    """A reader whose reads are ``TimedReads``: ``peer_s`` is its last load's peer phase."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timed = self._reads = TimedReads(self._opened)

    @property
    def peer_s(self) -> float:
        return self._timed.peer_s


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def loads(config: TieredConfig, state: dict, n: int) -> dict:
    """``n`` timed loads (after one warm-up); the peer phase's seconds and the groups opened."""
    target = {k: torch.empty_like(v) for k, v in state.items()}
    times, groups = [], []
    for i in range(n + 1):
        transport.OPENED.clear()
        dist.barrier()
        reader = TimedReader(config)
        dcp.load(target, storage_reader=reader)
        if i:
            times.append(slowest(reader.peer_s))
            groups.append(list(transport.OPENED))
        bad = [k for k in state if not torch.equal(target[k], state[k])]
        if bad:
            raise AssertionError(f"loaded wrong: {bad[0]}")
    dist.barrier()
    return {"peer_phase_s": times, "groups": groups, "store_keys": transport.store().num_keys()}


def rank_main(rank: int, port: int, root: str, args: dict, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % RANKS_PER_NODE),
        LOCAL_WORLD_SIZE=str(RANKS_PER_NODE),
        TIERED_DCP_RUNTIME_DIR=f"{root}/runtime",
    )
    warnings.filterwarnings("ignore")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
        state = {f"r{rank}.{k}": v for k, v in make_state(args["mib"]).items()}
        config = TieredConfig(
            "bench-peers",
            [Tier(f"{root}/ram/{{node}}", every=1, keep=1)],
            replication_factor=2,
            replication_jump=2,
        )
        dcp.save(state, storage_writer=TieredWriter(config, step=1))
        out = {"intact": loads(config, state, args["loads"])}
        dist.barrier()
        if rank == 0:
            shutil.rmtree(f"{root}/ram/1")
        dist.barrier()
        out["node_lost"] = loads(config, state, args["loads"])
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=20, help="timed loads of each kind (default 20)")
    ap.add_argument("--mib", type=int, default=4, help="state size per rank in MiB (default 4)")
    args = ap.parse_args()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="tdcp-bench-peers-", dir=base)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, root, vars(args), results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(WORLD):
            rank, kind, value = results.get(timeout=600)
            if kind != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    print(f"peer phase of a load, {WORLD} ranks on 2 nodes, slowest rank, {args.loads} loads (+1 warm-up)")
    print(f"{'load':<12}{'median ms':>10}{'min ms':>8}{'max ms':>8}  store keys  groups opened")
    for kind in ("intact", "node_lost"):
        times = out[0][kind]["peer_phase_s"]
        groups = {r: out[r][kind]["groups"][-1] for r in range(WORLD)}
        shown = {r: g for r, g in groups.items() if g}
        print(
            f"{kind:<12}{statistics.median(times) * 1e3:>10.1f}{min(times) * 1e3:>8.1f}"
            f"{max(times) * 1e3:>8.1f}  {out[0][kind]['store_keys']:>10}  {shown}"
        )
        summary[kind] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "store_keys_after": out[0][kind]["store_keys"],
            "groups_last_load": groups,
        }
    print(json.dumps({"bench": "peer_reads", "ranks": WORLD, "loads": args.loads, **summary}))


if __name__ == "__main__":
    main()
