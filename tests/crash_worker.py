"""A rank of a job that saves step 1, then a large step 2 (killed mid-way by the test)."""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredWriter

MiB = 1 << 20


def config(root: str) -> TieredConfig:
    return TieredConfig("crash", [Tier(f"{root}/ram/{{node}}", keep=1), Tier(f"{root}/ssd", every=1)])


def state(step: int, rank: int, mib: int) -> dict:
    return {f"r{rank}": torch.full((mib * MiB // 4,), float(step)), "step": step}


if __name__ == "__main__":
    root, mib = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config(root)
    dcp.save(state(1, rank, 1), storage_writer=TieredWriter(cfg, step=1))
    open(f"{root}/ready.{rank}", "w").close()
    dcp.save(state(2, rank, mib), storage_writer=TieredWriter(cfg, step=2))
    os._exit(0)
