"""What a load costs, and its peer phase: intact, and after a node loss.

    .venv/bin/python benchmarks/bench_peer_reads.py [--loads 20] [--mib 4]
    .venv/bin/python benchmarks/bench_peer_reads.py --mib 64 --loads 10 --baseline-tree PATH [--rounds 3]

Four real processes on gloo (torch.multiprocessing spawn) play two nodes
(LOCAL_WORLD_SIZE=2: ranks 0-1 on node 0, ranks 2-3 on node 1), replication 2/2 on one
node-local RAM tier under /dev/shm, each rank saving its own ``--mib`` MiB. One step is
saved, then loaded ``--loads`` times with every root intact and ``--loads`` times after
node 1's root is deleted. Timed per load, the slowest rank's time (all_reduce MAX):

- ``load``: the whole load, ``TieredReader(config)`` (choosing, agreeing on and leasing
  the step) and the load ``load_latest`` makes with it (each rank planning its own reads,
  the outcome agreed after: ``resume.load_planned_alone``; ``dcp.load`` on a tree without);
- ``peer phase``: ``step_reads.StepReads._read_from_peers`` alone (agreeing on the wish lists
  and moving the items);
- ``stock``: stock DCP's ``FileSystemReader`` loading the same state saved by its
  ``FileSystemWriter`` in /dev/shm (the protocol's cost without tiers, peers or checksums).

Printed is the median, the minimum and the maximum over the loads, after one discarded
warm-up load of each kind, and the groups the peer phase opened per load. Also printed:
the job store's key count after each kind of load (it must not grow from load to load).

``--baseline-tree PATH`` compares another checkout's code (e.g. ``git worktree add
/tmp/baseline <commit>``) with this one's: ``--rounds`` rounds, each running the bench once
on either tree in a process of its own (``bench_tree``: the ranks import tiered_dcp,
tiered_dcp.storage and tiered_dcp.planners from that tree, and the bench checks they did),
the trees taking turns going first. Printed are both trees' medians per round and the
ratio baseline/this tree of each round's median load (above 1: this tree is faster), and
the median of those ratios. Never fails on timing.
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
from typing import Any

import bench_tree  # first: TIERED_DCP_BENCH_TREE decides which tree's tiered_dcp is imported
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import exit_on_sigterm, make_state, slowest, spawn_ranks

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter

if os.path.isdir(os.path.join(bench_tree.TREE or ".", "tiered_dcp", "load")) or not bench_tree.TREE:
    from tiered_dcp.load.step_reads import StepReads
    from tiered_dcp.ranks import transport, worlds
else:  # a --baseline-tree from before the packages: its peer phase is not timed
    from tiered_dcp import transport  # type: ignore[attr-defined,no-redef]

    StepReads = object  # type: ignore[assignment,misc]

WORLD = 4
RANKS_PER_NODE = 2
KINDS = ("intact", "node_lost")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


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

    def _new_reads(self, opened: Any) -> TimedReads:
        return TimedReads(opened)

    @property
    def peer_s(self) -> float:
        return getattr(getattr(self, "_reads", None), "peer_s", float("nan"))  # a baseline tree: untimed


def load_as_resumed(target: dict, reader: TieredReader) -> None:
    """The load ``load_latest`` makes of the step it chose (``resume.load_planned_alone``:
    each rank plans its own reads); a baseline tree without it: ``dcp.load``."""
    from tiered_dcp.load import resume

    alone = getattr(resume, "load_planned_alone", None)
    if alone is None:
        dcp.load(target, storage_reader=reader)
    else:
        alone(target, reader)


def loads(config: TieredConfig, state: dict, n: int) -> dict:
    """``n`` timed loads (after one warm-up): the whole load's and the peer phase's seconds
    (slowest rank), and the groups opened."""
    target = {k: torch.empty_like(v) for k, v in state.items()}
    whole, peer, groups = [], [], []
    for i in range(n + 1):
        transport.OPENED.clear()
        dist.barrier()
        t0 = time.perf_counter()
        reader = TimedReader(config)
        load_as_resumed(target, reader)
        seconds = time.perf_counter() - t0
        if i:
            whole.append(slowest(seconds))
            peer.append(slowest(reader.peer_s))
            groups.append(list(transport.OPENED))
        bad = [k for k in state if not torch.equal(target[k], state[k])]
        if bad:
            raise AssertionError(f"loaded wrong: {bad[0]}")
    dist.barrier()
    return {
        "load_s": whole,
        "peer_phase_s": peer,
        "groups": groups,
        "store_keys": worlds.store().num_keys(),
    }


def stock_loads(path: str, state: dict, n: int) -> list[float]:
    """``n`` timed loads of the same state by stock DCP (``FileSystemReader``, the files in
    /dev/shm), after one warm-up: the slowest rank's seconds."""
    target = {k: torch.empty_like(v) for k, v in state.items()}
    seconds = []
    for i in range(n + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        took = slowest(time.perf_counter() - t0)
        if i:
            seconds.append(took)
    assert all(torch.equal(target[k], state[k]) for k in state)
    return seconds


def rank_main(rank: int, root: str, args: dict) -> dict:
    """One rank: save a step, time stock's loads, then ours intact and with node 1 lost."""
    state = {f"r{rank}.{k}": v for k, v in make_state(args["mib"]).items()}
    config = TieredConfig(
        "bench-peers",
        [Tier(f"{root}/ram/{{node}}", every=1, keep=1)],
        replication_factor=2,
        replication_jump=2,
    )
    dcp.save(state, storage_writer=TieredWriter(config, step=1))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/stock"))
    out: dict[str, Any] = {"stock": stock_loads(f"{root}/stock", state, args["loads"])}
    out["intact"] = loads(config, state, args["loads"])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/ram/1")
    dist.barrier()
    out["node_lost"] = loads(config, state, args["loads"])
    out["modules"] = bench_tree.loaded_from()
    return out


def run_once(args: argparse.Namespace) -> dict:
    """The bench on this process's tree: every rank's results."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="tdcp-bench-peers-", dir=base)
    try:
        env = {"LOCAL_WORLD_SIZE": RANKS_PER_NODE, "TIERED_DCP_RUNTIME_DIR": f"{root}/runtime"}
        spec = {"mib": args.mib, "loads": args.loads}
        return spawn_ranks(rank_main, WORLD, root, spec, env=env, timeout=280)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:>10.1f}{min(seconds) * 1e3:>8.1f}{max(seconds) * 1e3:>8.1f}"


def summarize(out: dict[int, Any], n: int) -> dict:
    """Print the table of one run; its figures as a dict (the JSON line)."""
    summary: dict[str, Any] = {"tree": bench_tree.TREE or HERE}
    print(f"a load, {WORLD} ranks on 2 nodes, slowest rank, {n} loads (+1 warm-up) of each kind")
    print(f"{'load':<12}{'what':<12}{'median ms':>10}{'min ms':>8}{'max ms':>8}  store keys  groups opened")
    for kind in KINDS:
        got = out[0][kind]
        groups = {r: out[r][kind]["groups"][-1] for r in range(WORLD)}
        shown = {r: g for r, g in groups.items() if g}
        print(f"{kind:<12}{'whole load':<12}{ms(got['load_s'])}")
        print(f"{'':<12}{'peer phase':<12}{ms(got['peer_phase_s'])}  {got['store_keys']:>10}  {shown}")
        summary[kind] = {
            "load_median_s": statistics.median(got["load_s"]),
            "load_min_s": min(got["load_s"]),
            "load_max_s": max(got["load_s"]),
            "median_s": statistics.median(got["peer_phase_s"]),
            "min_s": min(got["peer_phase_s"]),
            "max_s": max(got["peer_phase_s"]),
            "store_keys_after": got["store_keys"],
            "groups_last_load": groups,
        }
    stock = out[0]["stock"]
    print(f"{'stock':<12}{'whole load':<12}{ms(stock)}  (FileSystemReader, the same state in /dev/shm)")
    summary["stock"] = {"load_median_s": statistics.median(stock), "load_s": stock}
    summary["modules"] = out[0]["modules"]
    return summary


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    """The bench once, in a process of its own importing tiered_dcp from ``tree``; checked
    that every tiered_dcp module the ranks used came from there."""
    cmd = [sys.executable, os.path.abspath(__file__), "--loads", str(args.loads), "--mib", str(args.mib)]
    env = {**os.environ, "TIERED_DCP_BENCH_TREE": tree}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=290)
    if done.returncode:
        raise RuntimeError(f"bench on {tree} failed:\n{done.stdout}\n{done.stderr}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    prefixes = tuple(os.path.join(tree, d) + os.sep for d in bench_tree.PACKAGES.values())
    strays = {m: f for m, f in summary["modules"].items() if not f.startswith(prefixes)}
    if strays or "tiered_dcp.storage.local" not in summary["modules"]:
        raise RuntimeError(f"bench on {tree} imported tiered_dcp from elsewhere: {strays}")
    return summary


def compare(args: argparse.Namespace) -> None:
    """Alternate this tree and ``--baseline-tree`` for ``--rounds`` rounds; print ratios."""
    trees = {"baseline": os.path.abspath(args.baseline_tree), "this": HERE}
    rows: list[dict[str, dict]] = []
    for i in range(args.rounds):
        order = ["baseline", "this"] if i % 2 == 0 else ["this", "baseline"]
        row = {name: run_tree(trees[name], args) for name in order}
        rows.append(row)
        line = "  ".join(
            f"{name} {kind} {row[name][kind]['load_median_s'] * 1e3:.1f} ms"
            for name in order
            for kind in KINDS
        )
        print(f"round {i + 1}: {line}", flush=True)
    print(f"\nbaseline {trees['baseline']} vs this tree {trees['this']}")
    print(f"{WORLD} ranks, {args.mib} MiB per rank, median of {args.loads} loads per round, slowest rank")
    print("ratio = baseline / this (above 1: this tree is faster)")
    result: dict[str, Any] = {"bench": "peer_reads_compare", "mib": args.mib, "loads": args.loads, **trees}
    for kind in KINDS:
        for what, key in (("whole load", "load_median_s"), ("peer phase", "median_s")):
            base = [r["baseline"][kind][key] for r in rows]
            this = [r["this"][kind][key] for r in rows]
            ratios = [b / t for b, t in zip(base, this, strict=True)]
            print(
                f"{kind:<10} {what:<11} baseline {statistics.median(base) * 1e3:7.1f} ms  "
                f"this {statistics.median(this) * 1e3:7.1f} ms  ratio per round "
                f"{' '.join(f'{r:.2f}' for r in ratios)}  median {statistics.median(ratios):.2f}"
            )
            result[f"{kind}_{key}"] = {"baseline": base, "this": this, "ratios": ratios}
    stock = [r[name]["stock"]["load_median_s"] for r in rows for name in trees if "stock" in r[name]]
    if stock:  # measured beside either tree, the same each time
        this = statistics.median(r["this"]["intact"]["load_median_s"] for r in rows)
        print(
            f"stock DCP FileSystemReader, same state in /dev/shm: {statistics.median(stock) * 1e3:.1f} ms "
            f"(this tree's intact load {this / statistics.median(stock):.2f}x of it)"
        )
        result["stock_load_median_s"] = stock
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=20, help="timed loads of each kind (default 20)")
    ap.add_argument("--mib", type=int, default=4, help="state size per rank in MiB (default 4)")
    ap.add_argument("--baseline-tree", help="another checkout of this repository to compare with")
    ap.add_argument("--rounds", type=int, default=3, help="with --baseline-tree: runs per tree (default 3)")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    if args.baseline_tree:
        compare(args)
        return
    summary = summarize(run_once(args), args.loads)
    print(json.dumps({"bench": "peer_reads", "ranks": WORLD, "loads": args.loads, **summary}))


if __name__ == "__main__":
    main()
