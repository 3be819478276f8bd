"""A rank of a job in which rank 1 dies (SIGKILL) during step 2's save or before a load.

``save``: rank 1 kills itself while its part of step 2 is being resolved (a value whose
pickling kills the process): mid-save, after planning. ``load``: every rank saved step 1;
rank 1 kills itself before the load opens the step. Each survivor prints what it raised
as one JSON line on stdout.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, load_latest

MiB = 1 << 20


class DiesWhenSaved:
    """Pickled by DCP when the save resolves this rank's items: the process dies there."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def config(root: str) -> TieredConfig:
    return TieredConfig("loss", [Tier(f"{root}/ram/{{node}}", keep=2)], peer_timeout=5)


def state(step: int, rank: int) -> dict:
    return {f"r{rank}": torch.full((MiB // 4,), float(step)), "step": step}


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def describe(e: BaseException) -> dict:
    cause = e.__cause__
    return {
        "type": type(e).__name__,
        "message": str(e),
        "step": getattr(e, "step", None),
        "phase": getattr(e, "phase", None),
        "ranks": list(getattr(e, "ranks", ())),
        "cause": None if cause is None else type(cause).__name__,
    }


if __name__ == "__main__":
    root, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config(root)
    dcp.save(state(1, rank), storage_writer=TieredWriter(cfg, step=1))
    dist.barrier()
    if mode == "save":
        doomed = state(2, rank) | ({"dies": DiesWhenSaved()} if rank == 1 else {})
        try:
            dcp.save(doomed, storage_writer=TieredWriter(cfg, step=2))
            report(type=None)
        except BaseException as e:  # noqa: BLE001 - DCP's own collective raises torch's error
            report(**describe(e))
    else:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            (TieredReader(cfg).open() if mode == "open" else load_latest(state(0, rank), cfg))
            report(type=None)
        except BaseException as e:  # noqa: BLE001
            report(**describe(e))
    os._exit(0)
