"""One rank of a job wrapped in NVIDIA's in-process restart (nvidia-resiliency-ext's
``inprocess.Wrapper``, ``tests/test_nvrx_wrapper.py``), as its users write one on CPU:

    python nvrx_worker.py ROOT FAULT     (RANK, WORLD_SIZE, MASTER_ADDR/PORT set; no LOCAL_RANK)

Each call of the wrapped function joins a new world (the app's store under a prefix of the
Wrapper's iteration), reloads with ``load_latest`` and trains to step 12, an async save each
step to a RAM tier per node with every part replicated on the other node. Rank 1 fails once
after step 6's save: FAULT ``raise`` (an exception: every rank re-enters) or ``kill``
(SIGKILL: the Wrapper goes on with the 3 others). Each call prints a ``CALL`` JSON line.
"""

import datetime
import json
import logging
import os
import signal
import sys
import time
from typing import Optional  # NvRx finds its CallWrapper by this annotation (evaluated: no __future__)

import nvidia_resiliency_ext.inprocess as inprocess
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tiered_dcp
import tiered_dcp.inprocess
from tiered_dcp import Tier, TieredConfig, TieredWriter, load_latest

ROOT, FAULT = sys.argv[1], sys.argv[2]
CFG = TieredConfig(
    "nvrx", [Tier(f"{ROOT}/ram/{{node}}", keep=2)], replication_factor=2, replication_jump=2, peer_timeout=10
)
LAST = 12
FAILED = []
S = datetime.timedelta(seconds=1)


@inprocess.Wrapper(
    store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
    abort=inprocess.Compose(tiered_dcp.inprocess.Abort(), inprocess.abort.AbortTorchDistributed()),
    monitor_thread_interval=0.2 * S,
    monitor_process_interval=0.2 * S,
    progress_watchdog_interval=0.2 * S,
    last_call_wait=0.2 * S,
    heartbeat_interval=0.5 * S,
    heartbeat_timeout=5 * S,
    soft_timeout=30 * S,
    hard_timeout=45 * S,
    barrier_timeout=60 * S,
    completion_timeout=60 * S,
)
def train(call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:  # noqa: UP045
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert call_wrapper is not None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]) + 1,
        world_size=world,
        is_master=rank == 0,
        multi_tenant=True,
        wait_for_workers=True,
    )
    prefixed = dist.PrefixStore(f"iteration_{call_wrapper.iteration}", store)  # a world's own keys
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=5 * S)
    key = f"w{os.environ['NVRX_FIRST_RANK']}"  # this process's shard, whatever rank it is now
    state = {key: torch.zeros(1 << 16), "step": 0}
    t0 = time.perf_counter()
    try:
        step = load_latest(state, CFG)
    except tiered_dcp.NoCheckpointError:
        step = 0
    row = {
        "first_rank": int(os.environ["NVRX_FIRST_RANK"]),
        "iteration": call_wrapper.iteration,
        "rank": rank,
        "world": world,
        "loaded": step,
        "exact": step == 0
        or (torch.equal(state[key], torch.full((1 << 16,), float(step))) and state["step"] == step),
        "load_s": time.perf_counter() - t0,
    }
    print("CALL " + json.dumps(row), flush=True)
    for s in range(step + 1, LAST + 1):
        state = {key: torch.full((1 << 16,), float(s)), "step": s}
        tiered_dcp.inprocess.result(dcp.async_save(state, storage_writer=TieredWriter(CFG, step=s)))
        if s == 6 and os.environ["NVRX_FIRST_RANK"] == "1" and not FAILED:
            FAILED.append(s)
            if FAULT == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected fault")
    print("DONE " + json.dumps({"first_rank": int(os.environ["NVRX_FIRST_RANK"]), "step": LAST}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    os.environ["NVRX_FIRST_RANK"] = os.environ["RANK"]
    train()
