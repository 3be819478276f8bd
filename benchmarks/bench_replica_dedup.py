"""Dedup with clique replication: what a save sends to peers and writes, first save vs the next.

    .venv/bin/python benchmarks/bench_replica_dedup.py [--mib 64] [--steps 4]

Four real processes on gloo (spawn) play two nodes (LOCAL_WORLD_SIZE=2), one node-local
RAM tier (``keep=2``) in /dev/shm, ``replication_factor=2, replication_jump=2``: every node
holds every part. Each rank saves ``--mib`` MiB of a LoRA-style state: 90% frozen
backbone, 10% adapter that changes at every step. The same steps are saved with
``dedup=False`` and ``dedup=True`` (alternating, step by step). Per save:

- ``sent``: bytes the ranks sent their clique peers (``TieredWriter.sent_bytes``, summed);
- ``written``: bytes of files new or rewritten in both node roots (inode changes);
- ``save_s``: a synchronous ``dcp.save``, slowest rank.

The first save has nothing to dedup against; the later ones are the median of steps
2..``--steps``. Prints a table, then one line of JSON. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_replication import on_rank0, timed  # noqa: E402
from common import MiB, exit_on_sigterm, files, new_bytes, spawn_ranks  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredWriter

WORLD = 4
RANKS_PER_NODE = 2
MODES = ("plain", "dedup")


def rank_state(rank: int, mib: int, step: int) -> dict:
    """90% frozen (the same every step), 10% adapter (new every step); this rank's own keys."""
    frozen, adapter = mib * MiB * 9 // 10 // 4, mib * MiB // 10 // 4
    g = torch.Generator().manual_seed(rank)
    a = torch.Generator().manual_seed(1000 * step + rank)
    out = {f"r{rank}.backbone{i}": torch.randn(frozen // 8, generator=g) for i in range(8)}
    out[f"r{rank}.adapter"] = torch.randn(adapter, generator=a)
    return out


def rank_main(rank: int, root: str, args: dict) -> dict[str, list[dict]]:
    """One rank: each mode's saves, timed, and the bytes sent and written."""
    configs = {
        mode: TieredConfig(
            f"bench-{mode}",
            [Tier(f"{root}/ram/{{node}}", keep=2)],
            replication_factor=2,
            replication_jump=2,
            dedup=mode == "dedup",
        )
        for mode in MODES
    }
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for step in range(1, args["steps"] + 1):
        state = rank_state(rank, args["mib"], step)
        for mode in MODES if step % 2 else MODES[::-1]:
            before: dict = {}
            on_rank0(lambda b=before, m=mode: b.update(files(f"{root}/ram/*/bench-{m}")))
            writer = TieredWriter(configs[mode], step=step)
            seconds = timed(lambda w=writer, s=state: dcp.save(s, storage_writer=w))
            sent = torch.tensor([writer.sent_bytes], dtype=torch.int64)
            dist.all_reduce(sent)
            written = [0]
            on_rank0(
                lambda b=before, m=mode, w=written: w.__setitem__(
                    0, new_bytes(b, files(f"{root}/ram/*/bench-{m}"))
                )
            )
            rows[mode].append(
                {"step": step, "save_s": seconds, "sent": int(sent.item()), "written": written[0]}
            )
    return rows


def main() -> None:

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="state size per rank in MiB (default 64)")
    ap.add_argument("--steps", type=int, default=4, help="saves per mode (default 4)")
    args = ap.parse_args()
    exit_on_sigterm()  # a killed run still removes its directories
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="tdcp-bench-repl-dedup-", dir=base)
    started = time.monotonic()
    try:
        env = {"LOCAL_WORLD_SIZE": RANKS_PER_NODE, "TIERED_DCP_RUNTIME_DIR": f"{root}/runtime"}
        out = spawn_ranks(rank_main, WORLD, root, {"mib": args.mib, "steps": args.steps}, env=env)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = out[0]
    summary = {}
    for mode in MODES:
        first, later = rows[mode][0], rows[mode][1:]
        summary[mode] = {
            "first": {k: first[k] for k in ("sent", "written", "save_s")},
            "later": {k: statistics.median(r[k] for r in later) for k in ("sent", "written", "save_s")},
        }
    ratios = {
        f"{mode}_{k}_later_vs_first": summary[mode]["later"][k] / summary[mode]["first"][k]
        for mode in MODES
        for k in ("sent", "written", "save_s")
    }
    print(
        f"{WORLD} ranks on 2 nodes x {args.mib} MiB (90% frozen), replication 2, RAM tier; "
        f"first save vs the median of saves 2..{args.steps}"
    )
    print(f"{'mode':<7}{'save':<7}{'sent MiB':>10}{'written MiB':>13}{'save s':>9}")
    for mode in MODES:
        for which in ("first", "later"):
            r = summary[mode][which]
            print(
                f"{mode:<7}{which:<7}{r['sent'] / MiB:>10.1f}{r['written'] / MiB:>13.1f}{r['save_s']:>9.3f}"
            )
    print()
    for k, v in ratios.items():
        print(f"{k:<36}{v:>7.3f}")
    print(f"wall time: {time.monotonic() - started:.1f} s")
    print(
        json.dumps(
            {"bench": "replica_dedup", "ranks": WORLD, "mib_per_rank": args.mib, **summary, "ratios": ratios}
        )
    )


if __name__ == "__main__":
    main()
