"""A training loop the preemption tests SIGTERM: `python preemption_worker.py MODE ROOT`.

Steps take STEP_SECONDS; an async save is scheduled every 10th step (the RAM tier takes
every 10th, the SSD every 20th). At every step boundary the loop asks whether the job is
being preempted (MODE "ask": ``tiered_dcp.preemption_requested()``, agreed by the ranks
when WORLD_SIZE > 1; MODE "callback": a flag set by ``tiered_dcp.on_preemption``) and if so
saves that step with ``emergency=True`` and exits 0 at once, leaving the slower tier to the
writer process. It prints "scheduled N" once step N's async save is staged and
"emergency N" once the emergency save returned.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tiered_dcp
from tiered_dcp import Tier, TieredConfig, TieredWriter

STEP_SECONDS = 0.3
LAST = 40  # the loop never gets this far in the tests


def config(root: str) -> TieredConfig:
    return TieredConfig(
        "preempt",
        [Tier(f"{root}/ram/{{node}}", every=10, keep=2), Tier(f"{root}/ssd/{{node}}", every=20, keep=2)],
    )


def state(step: int, rank: int = 0) -> dict:
    return {f"w{rank}": torch.full((4, 1 << 20), float(step)), "step": step}  # 16 MiB per rank


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    # async saves' collectives run in a thread: a group of their own, apart from the loop's
    save_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    cfg = config(root)
    current = state(0, rank)
    told = threading.Event()
    if mode == "callback":
        tiered_dcp.on_preemption(told.set)
    pending = None
    for step in range(1, LAST):
        time.sleep(STEP_SECONDS)  # forward, backward
        current[f"w{rank}"].fill_(float(step))  # optimizer step
        current["step"] = step
        preempted = told.is_set() if mode == "callback" else tiered_dcp.preemption_requested()
        if preempted:
            if pending is not None:
                pending.result()
            dcp.save(current, storage_writer=TieredWriter(cfg, step, emergency=True))
            print(f"emergency {step}", flush=True)
            if dist.is_initialized():
                dist.destroy_process_group()
            return
        if step % 10 == 0:
            if pending is not None:
                pending.result()
            pending = dcp.async_save(
                current, storage_writer=TieredWriter(cfg, step), process_group=save_group
            )
            print(f"scheduled {step}", flush=True)
    print("not preempted", flush=True)


if __name__ == "__main__":
    main()
