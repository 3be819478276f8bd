"""What comparing data-parallel replicas costs an async save.

    .venv/bin/python benchmarks/bench_replica_compare.py [--mib 64] [--saves 30]

Four real processes on gloo (spawn) play two nodes (LOCAL_WORLD_SIZE=2), one node-local
RAM tier (``keep=2``) in /dev/shm. Each rank holds ``--mib`` MiB: half its own (keys of
its own), half replicated (the same keys and bytes on every rank: DCP writes each on one
rank and drops the other copies, which the comparison hashes). The same steps are saved
with ``dcp.async_save`` with ``on_replica_mismatch="mark"`` (the default: every copy
compared) and ``"ignore"`` (nothing compared), alternating save by save, the first of
each pair swapped every step. Per save, on the slowest rank:

- ``stall``: ``async_save`` returning (the staging copy the training loop waits for);
- ``background``: from then to the future's result (the part written, the comparison,
  the commit agreement).

Medians over ``--saves`` saves per mode after one warm-up pair; the targets: background
with the comparison <= 1.05x without, stall <= 1.02x. Then one more save, one replicated
copy made odd on one rank: it must be caught (its step passed over), so the figures are
of a comparison that runs. Prints a table, then one line of JSON. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import MiB, spawn_ranks

from tiered_dcp import Tier, TieredConfig, TieredWriter, latest_step, shutdown

WORLD = 4
RANKS_PER_NODE = 2
MODES = {"compared": "mark", "not compared": "ignore"}


def rank_state(rank: int, mib: int, step: int) -> dict:
    """Half this rank's own keys, half keys (and bytes) every rank holds; new values each step."""
    per = mib * MiB // 2 // 8 // 4  # float32 elements of each of 8 tensors per half
    own = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(1000 * step)
    out = {f"r{rank}.own{i}": torch.randn(per, generator=own) for i in range(8)}
    out |= {f"replicated{i}": torch.randn(per, generator=shared) for i in range(8)}
    return out


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rank_main(rank: int, root: str, args: dict) -> dict:
    """One rank: the saves of each mode, alternating; the slowest rank's times of each; then
    whether a copy made odd on purpose was caught."""
    configs = {
        mode: TieredConfig(f"bench-{i}", [Tier(f"{root}/{{node}}", keep=2)], on_replica_mismatch=policy)
        for i, (mode, policy) in enumerate(MODES.items())
    }
    times: dict[str, dict[str, list[float]]] = {m: {"stall": [], "background": []} for m in MODES}
    for step in range(args["saves"] + 1):
        state = rank_state(rank, args["mib"], step)
        for mode in list(MODES)[:: 1 if step % 2 else -1]:
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(state, storage_writer=TieredWriter(configs[mode], step=step))
            stall = time.perf_counter() - t0
            fut.result()
            background = time.perf_counter() - t0 - stall
            stall, background = slowest(stall), slowest(background)
            if step:  # the first pair warms the staging buffers, the tier and the writers
                times[mode]["stall"].append(stall)
                times[mode]["background"].append(background)
    # the check is on: one copy made odd is caught, and that step is passed over
    state = rank_state(rank, args["mib"], args["saves"] + 1)
    if rank == WORLD - 1:
        state["replicated0"][0] += 1.0
    last = args["saves"] + 1
    dcp.async_save(state, storage_writer=TieredWriter(configs["compared"], step=last)).result()
    caught = latest_step(configs["compared"]) == args["saves"]
    shutdown()
    return {"times": times, "caught": caught}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64, help="MiB per rank, half of it replicated")
    p.add_argument("--saves", type=int, default=30, help="saves per mode, after one warm-up pair")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-replicas-", dir="/dev/shm")
    try:
        t0 = time.perf_counter()
        out = spawn_ranks(rank_main, WORLD, root, vars(args), env={"LOCAL_WORLD_SIZE": RANKS_PER_NODE})
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times, caught = out[0]["times"], out[0]["caught"]  # every rank holds the slowest rank's figures
    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    ratio = {k: med["compared"][k] / med["not compared"][k] for k in ("stall", "background")}
    print(
        f"replicas compared, {WORLD} ranks on {WORLD // RANKS_PER_NODE} nodes, {args.mib} MiB a rank "
        f"(half replicated), async_save to a RAM tier, medians of {args.saves} saves (slowest rank)"
    )
    print(f"{'mode':<16}{'stall s':>10}{'background s':>14}")
    for m in MODES:
        print(f"{m:<16}{med[m]['stall']:>10.4f}{med[m]['background']:>14.4f}")
    print(f"\nbackground, compared / not: {ratio['background']:.3f} (target <= 1.05)")
    print(f"stall, compared / not:      {ratio['stall']:.3f} (target <= 1.02)")
    print(f"a copy made odd on purpose afterwards: caught, its step passed over: {caught}")
    print(
        json.dumps(
            {
                "mib": args.mib,
                "saves": args.saves,
                "median_s": med,
                "ratio": ratio,
                "caught": caught,
                "wall_s": round(wall, 1),
                "runs_s": times,
            }
        )
    )


if __name__ == "__main__":
    main()
