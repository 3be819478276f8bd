"""Small checkpoints written by older versions of tiered-dcp, kept under tests/data/.

``tests/data/format1`` was written by commit 3d809c7 (format 1: no index files, the
metadata's records are authoritative) and ``tests/data/format2`` by commit 1c07b87
(format 2: a pickled ``{MetadataIndex: record}`` index next to every part a writer
process or a replica swap wrote), each with this script run by that version's code:

    git archive <commit> | tar -x -C /tmp/old     # then lay storage/, planners/ inside
    PYTHONPATH=<that layout> .venv/bin/python tests/legacy_checkpoints.py tests/data/formatN

Two ranks on gloo, one node each. Step 1 goes to the shared zstd "bucket" only (its
first tier: committed by the coordinator); step 2 to the node-local "ram" tier (format
2: replicated to the other node, replication 2/1) and then to the bucket (format 2: by
the writer process). The tests load both with today's reader and compare exact values.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

NAMESPACE = "legacy"
STEPS = (1, 2)


def config(root: str, format_version: int):
    from tiered_dcp import Tier, TieredConfig

    tiers = [
        Tier(f"{root}/ram/{{node}}", every=2),
        Tier(f"{root}/bucket", compression="zstd", shared=True),
    ]
    replication = {"replication_factor": 2, "replication_jump": 1} if format_version >= 2 else {}
    return TieredConfig(NAMESPACE, tiers, **replication)


def full_state(step: int) -> dict:
    """Every value of a step as one process sees it whole (the DTensor unsharded)."""
    return {
        "common": torch.arange(10, dtype=torch.int64) + step,
        "own0": torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * step,
        "own1": torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * step + 10,
        "nested": {
            "half": torch.arange(4, dtype=torch.bfloat16) * step,
            "ids": [step, "two", torch.arange(3)],
        },
        "dt": torch.arange(32, dtype=torch.float32).reshape(8, 4) * step,
        "meta": {"epoch": 7 * step, "name": f"legacy-{step}"},
    }


def rank_state(step: int, rank: int, mesh) -> dict:
    """What rank saves: shared values, one tensor of its own, and its shard of ``dt``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = full_state(step)
    state = {k: v for k, v in full.items() if k not in ("own0", "own1", "dt")}
    state[f"own{rank}"] = full[f"own{rank}"]
    state["dt"] = distribute_tensor(full["dt"], mesh, [Shard(0)])
    return state


def _rank(rank: int, world: int, root: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one node per rank
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import tiered_dcp

    try:
        from tiered_dcp.storage.format import FORMAT_VERSION
    except ImportError:  # formats 1 and 2 kept it in catalog
        from tiered_dcp.steps.catalog import FORMAT_VERSION

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    cfg = config(root, FORMAT_VERSION)
    for step in STEPS:
        dcp.save(rank_state(step, rank, mesh), storage_writer=tiered_dcp.TieredWriter(cfg, step=step))
    if hasattr(tiered_dcp, "shutdown"):
        tiered_dcp.shutdown(wait=True, timeout=60)  # the writer process has filled the bucket
    dist.barrier()
    dist.destroy_process_group()


def main(out: str) -> None:
    import socket

    import torch.multiprocessing as mp

    os.environ.setdefault("TIERED_DCP_RUNTIME_DIR", tempfile.mkdtemp(prefix="tdcp-legacy-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, os.path.abspath(out), port), nprocs=2)


if __name__ == "__main__":
    main(sys.argv[1])
