"""One rank of a job that restarts inside its processes, as NVIDIA's in-process restart does
(``tests/test_inprocess.py``): each world is a default process group on the job's store
under a prefix of its own (``_inprocess_<n>``, as NvRx names them).

    python inprocess_worker.py RANK SIZES STORE_PORT ROOT FIRST_WORLD LAST_WORLD KILL_AT

SIZES: each world's size, comma-separated (``4,3,3``: a job that goes on without a rank).

Each world ``n`` from FIRST_WORLD to LAST_WORLD: join it, ``load_latest`` (nothing in the
first world), train steps with an async save each (a RAM tier per node, every part also on
a clique peer of another node), and leave it with ``tiered_dcp.abort()`` and
``destroy_process_group``. The rank whose number is KILL_AT's kills itself (SIGKILL) after
world ``FIRST_WORLD``'s steps: the test starts a replacement in the next world, a fresh
process whose counters start at nothing while the survivors' do not. Each world prints one
``WORLD`` JSON line: the step loaded, whether it was exact, the steps saved.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredWriter, abort, load_latest

STEPS = 3  # trained and saved per world
MIB = 2


def state_at(step: int, rank: int) -> dict:
    """This rank's shard (a key of its own: a plain tensor under one key on every rank
    would be a replicated one, saved once) and the step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {f"w{rank}": torch.randn(MIB * (1 << 20) // 4, generator=g), "step": step}


def zeros(rank: int) -> dict:
    return {f"w{rank}": torch.zeros(MIB * (1 << 20) // 4), "step": -1}


def main() -> None:
    rank, sizes, port = int(sys.argv[1]), [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
    root, first, last, kill_at = sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
    base = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    cfg = TieredConfig(
        "inproc",
        [Tier(f"{root}/ram/{{node}}", keep=2)],
        replication_factor=2,
        replication_jump=2,
        peer_timeout=10,
        failure_domain="RACK" if os.environ.get("RACK") else None,  # a rack per node, if given
    )
    for n in range(first, last + 1):
        store = dist.PrefixStore(f"_inprocess_{n}", base)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=sizes[n])
        t0 = time.monotonic()
        state = zeros(rank)
        loaded = None
        if n > 0:
            loaded = load_latest(state, cfg)
        load_s = time.monotonic() - t0
        exact = loaded is None or (
            torch.equal(state[f"w{rank}"], state_at(loaded, rank)[f"w{rank}"]) and state["step"] == loaded
        )
        start = 0 if loaded is None else loaded
        saved = []
        for step in range(start + 1, start + STEPS + 1):
            state = state_at(step, rank)  # a training step
            dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step)).result()
            saved.append(step)
        print(
            "WORLD "
            + json.dumps(
                {"world": n, "rank": rank, "loaded": loaded, "exact": exact, "saved": saved, "load_s": load_s}
            ),
            flush=True,
        )
        dist.barrier()
        if rank == kill_at and n == first:
            os.kill(os.getpid(), signal.SIGKILL)
        abort()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
