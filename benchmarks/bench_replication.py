"""What clique replication adds to a save, and what a load after a node loss costs.

    .venv/bin/python benchmarks/bench_replication.py [--mib 64] [--runs 5]

Four real processes on gloo (``common.spawn_ranks``) play two nodes
(LOCAL_WORLD_SIZE=2: ranks 0-1 on node 0, ranks 2-3 on node 1). Each rank saves its own
``--mib`` MiB: 32 float32 tensors under rank-specific keys (``r<rank>.layer<i>.weight``).
Every figure is the slowest rank's time (a barrier before, all_reduce MAX after), the
median of ``--runs`` rounds after one discarded warm-up round. Node roots, the "bucket"
and the writers' runtime directory all live in one temporary directory under /dev/shm.

Save, one node-local RAM tier with ``keep=2`` (a single tier, so no writer process is
involved); the two modes alternate within every round (their order flips every round):

- ``save_unreplicated_s``: a synchronous ``dcp.save``, ``replication_factor=1``;
- ``save_replicated_s``: the same with ``replication_factor=2, replication_jump=2`` (cliques
  {0, 2} and {1, 3}: every node holds every part, its ranks' own and their peers');
- ``stall_unreplicated_s`` / ``stall_replicated_s``: what the training loop waits for with
  ``dcp.async_save`` (on a gloo group of its own) in the same two configurations; each
  save's future is then waited for, untimed.

Load, a RAM tier plus a shared "bucket" directory (both ``keep=2``; the bucket lies in
/dev/shm too, so its figure is a floor for a real bucket), replication 2/2. Every round
saves a step, waits until the bucket has it and the writers are idle (untimed), then times
``dcp.load`` with a fresh ``TieredReader`` (its construction, where the ranks agree on the
step, included):

- ``load_intact_s``: every node's RAM root intact, every rank reads its own root;
- ``load_bucket_only_s``: with a config holding only the bucket tier;
- ``load_node_lost_s``: after node 1's RAM root is deleted: ranks 2 and 3 get their items
  from their clique peers 0 and 1 over gloo.

Every load is checked against the saved state (untimed). Prints a table, then one line of
JSON. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import MiB, exit_on_sigterm, make_state, report, spawn_ranks  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, wait_for, writer_status

warnings.filterwarnings("ignore")

WORLD = 4
RANKS_PER_NODE = 2
SAVE_MODES = ("save_unreplicated_s", "save_replicated_s")
LOAD_MODES = ("load_intact_s", "load_bucket_only_s", "load_node_lost_s")


class Captured(logging.Handler):
    """tiered_dcp's warnings in this rank (a peer that did not answer, a damaged copy...)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("tiered_dcp").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def rank_state(rank: int, mib: int) -> dict:
    """This rank's own ``mib`` MiB, under keys no other rank uses, with values of its own."""
    return {f"r{rank}.{k}": v.add_(rank) for k, v in make_state(mib).items()}


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` took on the slowest rank (every rank starts together)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def on_rank0(fn: Callable[[], Any]) -> None:
    """Run ``fn`` on rank 0 alone, between barriers (a file-system change every rank sees)."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def settle(config: TieredConfig, timeout: float) -> None:
    """Wait (untimed) until the writer processes on this machine have nothing queued."""
    deadline = time.monotonic() + timeout
    while any(w.queue for w in writer_status(config)) and time.monotonic() < deadline:
        time.sleep(0.01)


def check(target: dict, state: dict, what: str) -> None:
    bad = [k for k in state if not torch.equal(target[k], state[k])]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} tensor(s) loaded wrong, e.g. {bad[0]}")


def bench_save(root: str, state: dict, runs: int, times: dict) -> None:
    tier = Tier(f"{root}/ram/{{node}}", every=1, keep=2)
    configs = {
        "save_unreplicated_s": TieredConfig("bench-repl-save-f1", [tier]),
        "save_replicated_s": TieredConfig(
            "bench-repl-save-f2", [tier], replication_factor=2, replication_jump=2
        ),
    }
    group = dist.new_group(backend="gloo")  # async saves get a group of their own, as in training
    for step in range(1, runs + 2):  # step 1 is the warm-up round
        order = SAVE_MODES if step % 2 else SAVE_MODES[::-1]
        for mode in order:
            writer = TieredWriter(configs[mode], step=step)
            times[mode].append(timed(lambda w=writer: dcp.save(state, storage_writer=w)))
        for mode in order:  # the training loop's stall; replication runs in the upload
            writer, futures = TieredWriter(configs[mode], step=100 + step), []

            def save(w: TieredWriter = writer, f: list = futures) -> None:
                f.append(dcp.async_save(state, storage_writer=w, process_group=group))

            times[mode.replace("save_", "stall_")].append(timed(save))
            futures[0].result()  # untimed: until committed, replicas included


def bench_load(root: str, state: dict, runs: int, times: dict, timeout: float) -> list[list[int]]:
    """The load modes, round by round; returns the tiers holding the step after each node loss."""
    ram = Tier(f"{root}/ram/{{node}}", every=1, keep=2)
    bucket = Tier(f"{root}/bucket", every=1, keep=2, shared=True)
    ns = "bench-repl-load"
    config = TieredConfig(ns, [ram, bucket], replication_factor=2, replication_jump=2)
    configs = {
        "load_intact_s": config,
        "load_bucket_only_s": TieredConfig(ns, [bucket]),
        "load_node_lost_s": config,
    }
    target = {k: torch.empty_like(v) for k, v in state.items()}
    tiers_after_loss = []
    for step in range(1, runs + 2):  # step 1 is the warm-up round (and starts the writers)
        next(iter(state.values()))[0] = step  # a training step changed the state
        dcp.save(state, storage_writer=TieredWriter(config, step=step))
        wait_for(config, step, timeout=timeout)
        settle(config, timeout)
        for mode in LOAD_MODES:  # the node loss last: it destroys node 1's copies
            if mode == "load_node_lost_s":
                on_rank0(lambda: shutil.rmtree(f"{root}/ram/1"))
            for t in target.values():
                t.zero_()
            readers: list[TieredReader] = []

            def load(cfg: TieredConfig = configs[mode], readers: list = readers) -> None:
                readers.append(TieredReader(cfg))
                dcp.load(target, storage_reader=readers[0])

            times[mode].append(timed(load))
            reader = readers[0]
            if reader.step != step:
                raise AssertionError(f"{mode}: loaded step {reader.step}, expected {step}")
            check(target, state, f"{mode}, step {step}")
            if mode == "load_node_lost_s":
                tiers_after_loss.append(reader.tiers)
    return tiers_after_loss


def rank_main(rank: int, root: str, args: dict) -> dict:
    """One rank of the benchmark (``common.spawn_ranks``): its figures and the warnings it logged."""
    captured = Captured()
    state = rank_state(rank, args["mib"])
    stalls = [m.replace("save_", "stall_") for m in SAVE_MODES]
    times: dict[str, list[float]] = {k: [] for k in (*SAVE_MODES, *stalls, *LOAD_MODES)}
    bench_save(f"{root}/save", state, args["runs"], times)
    on_rank0(lambda: shutil.rmtree(f"{root}/save"))
    tiers = bench_load(f"{root}/load", state, args["runs"], times, args["timeout"])
    clean = shutdown(wait=True, timeout=120)  # this rank's writer process exits
    return {"times": times, "tiers_after_loss": tiers, "clean_shutdown": clean, "warnings": captured.lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="state size per rank in MiB (default 64)")
    ap.add_argument(
        "--runs", type=int, default=5, help="rounds after one warm-up round; the median is reported"
    )
    ap.add_argument("--timeout", type=float, default=600, help="give up on the ranks after this many seconds")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="tdcp-bench-repl-", dir=base)
    started = time.monotonic()
    try:
        spec = {"mib": args.mib, "runs": args.runs, "timeout": args.timeout}
        env = {"LOCAL_WORLD_SIZE": RANKS_PER_NODE, "TIERED_DCP_RUNTIME_DIR": f"{root}/runtime"}
        out = spawn_ranks(rank_main, WORLD, root, spec, env=env, timeout=args.timeout)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.monotonic() - started

    samples = out[0]["times"]  # every rank holds the same (all-reduced) figures
    res = {k: statistics.median(v[1:]) for k, v in samples.items()}
    ratios = {
        "save_replicated_vs_unreplicated": res["save_replicated_s"] / res["save_unreplicated_s"],
        "async_stall_replicated_vs_unreplicated": res["stall_replicated_s"] / res["stall_unreplicated_s"],
        "load_node_lost_vs_intact": res["load_node_lost_s"] / res["load_intact_s"],
        "load_node_lost_vs_bucket_only": res["load_node_lost_s"] / res["load_bucket_only_s"],
        "load_bucket_only_vs_intact": res["load_bucket_only_s"] / res["load_intact_s"],
    }
    targets = {"save_replicated_vs_unreplicated": ("<=", 1.5)}
    per_rank = args.mib * MiB
    nbytes = WORLD * per_rank
    title = (
        f"state: {WORLD} ranks on 2 nodes x {per_rank / MiB:.0f} MiB in 32 tensors "
        f"(GB/s over all {nbytes / MiB:.0f} MiB); slowest rank, median of {args.runs} rounds (+1 warm-up)"
    )
    met = report(title, nbytes, res, ratios, targets)
    tiers_after_loss = out[0]["tiers_after_loss"]
    warned = {r: o["warnings"] for r, o in sorted(out.items()) if o["warnings"]}
    print(f"\ntiers holding the step after node 1's loss, per round: {tiers_after_loss}")
    print(f"tiered_dcp warnings: {sum(len(v) for v in warned.values())}")
    for r, lines in warned.items():
        for line in lines:
            print(f"  rank {r}: {line}")
    print(f"wall time: {elapsed:.1f} s")
    print(
        json.dumps(
            {
                "bench": "replication",
                "ranks": WORLD,
                "bytes_per_rank": per_rank,
                "bytes": nbytes,
                "runs": args.runs,
                "seconds": res,
                "ratios": ratios,
                "targets": {k: f"{op} {x}" for k, (op, x) in targets.items()},
                "met": met,
                "samples": samples,
                "warnings": sum(len(v) for v in warned.values()),
                "clean_shutdown": all(o["clean_shutdown"] for o in out.values()),
                "wall_s": round(elapsed, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
