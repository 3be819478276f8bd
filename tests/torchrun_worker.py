"""A training loop that torchrun runs (tests/test_torchrun.py).

`torchrun ... torchrun_worker.py ROOT STEPS DIE_AT`: each rank holds a DTensor sharded over
the ranks, a replicated tensor and the step. It resumes from the newest complete step (if
any), trains to STEPS saving every step, and on the first attempt
(TORCHELASTIC_RESTART_COUNT=0) the last rank SIGKILLs itself after training step DIE_AT,
before saving it: the other ranks fail in that save's collectives and torchrun restarts the
whole job. Each rank writes what it resumed from to ROOT/rank<r>.attempt<n>.json and its
final shard to ROOT/rank<r>.pt.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tiered_dcp import NoCheckpointError, Tier, TieredConfig, TieredWriter, latest_step, load_latest

N = 64  # rows of the sharded weight


def config(root: str) -> TieredConfig:
    return TieredConfig(
        "trun",
        [Tier(f"{root}/ram/{{node}}", every=1, keep=2), Tier(f"{root}/ssd/{{node}}", every=3, keep=2)],
    )


def initial() -> dict[str, torch.Tensor]:
    """The full (unsharded) state before step 1."""
    return {
        "w": torch.arange(N * 4, dtype=torch.float64).reshape(N, 4),
        "b": torch.ones(3, dtype=torch.float64),
    }


def train(full: dict[str, torch.Tensor], step: int) -> None:
    """One deterministic step on full tensors or on their shards alike (elementwise)."""
    full["w"].mul_(0.5).add_(step)
    full["b"].add_(step * 0.25)


def expected(steps: int) -> dict[str, torch.Tensor]:
    state = initial()
    for step in range(1, steps + 1):
        train(state, step)
    return state


def main() -> None:
    root, steps, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (world,))
    full = initial()
    w = DTensor.from_local(full["w"].chunk(world)[rank].clone(), mesh, [Shard(0)])
    state = {"w": w, "b": full["b"], "step": 0}
    cfg = config(root)
    try:
        resumed = load_latest(state, cfg)  # the resume call
    except NoCheckpointError:
        resumed = None
    newest_here = latest_step(cfg)  # what this node's RAM tier held, committed, at the restart
    with open(f"{root}/rank{rank}.attempt{attempt}.json", "w") as f:
        json.dump({"resumed": resumed, "step_in_state": state["step"], "latest": newest_here}, f)
    local = {"w": state["w"].to_local(), "b": state["b"]}
    for step in range(state["step"] + 1, steps + 1):
        train(local, step)
        if attempt == 0 and step == die_at and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        state["step"] = step
        dcp.save(state, storage_writer=TieredWriter(cfg, step=step))
    torch.save(local, f"{root}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
