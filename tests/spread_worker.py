"""A rank of a job saving to, or restarting from, a bucket tier (tests/test_spread.py).

    python spread_worker.py '{"mode": "save"|"load", "layout": "ddp"|"hsdp"|"fsdp", ...}'

The state is known on every rank from its layout alone, so a load checks itself:
``ddp`` a replicated plain tensor and byte value beside a small tensor of each rank's own;
``hsdp`` a DTensor on a (replicate, shard) mesh; ``fsdp`` a DTensor sharded over every rank.
A load targets ``load_layout`` (another layout or world size: resharding). ``die`` names a
rank that SIGKILLs itself as its reads begin. Prints one JSON line: whether the load was
exact, the reader's failures by kind, and the error raised, if any.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown
from tiered_dcp.load.device_reads import HostCopier, Ring
from tiered_dcp.ranks import transport

ROWS, COLS = 4096, 512  # 8 MiB of float32


def config(a: dict) -> TieredConfig:
    tiers = [Tier(a["url"], shared=True, storage_options=a["options"])]
    if a.get("second"):  # a slower shared tier holding every step too
        tiers.append(Tier(a["second"], shared=True))
    return TieredConfig("spread", tiers, peer_timeout=a.get("peer_timeout", 60))


def whole() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def state(layout: str, rank: int, world: int, empty: bool) -> dict:
    fill = (lambda t: torch.zeros_like(t)) if empty else (lambda t: t)
    if layout == "ddp":
        return {
            "w": fill(whole()),
            f"r{rank}": fill(torch.full((1 << 14,), float(rank))),
            "lr": -1.0 if empty else 0.25,
            "none": torch.empty(0),  # every rank's too: an empty item, spread with nothing to send
        }
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        placements = [Replicate(), Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        placements = [Shard(0)]
    return {"g": distribute_tensor(fill(whole()), mesh, placements)}


def exact(got: dict, want: dict) -> bool:
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            if hasattr(v, "full_tensor"):
                v, g = v.full_tensor(), g.full_tensor()
            if not torch.equal(g, v):
                return False
        elif g != v:
            return False
    return True


class Counting(HostCopier):
    """The ring's host copy, counting the bytes that crossed it."""

    copied = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copied += src.numel()
        dst.copy_(src)


class DiesAsItReads(TieredReader):
    def read_data(self, plan, planner):
        os.kill(os.getpid(), signal.SIGKILL)


def describe(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ()))}


def main() -> None:
    a = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(a)
    if a["mode"] == "save":
        dcp.save(state(a["layout"], rank, world, False), storage_writer=TieredWriter(cfg, step=1))
        shutdown()
        print(json.dumps({"saved": True}), flush=True)
        os._exit(0)
    layout = a.get("load_layout", a["layout"])
    target, want = state(layout, rank, world, True), state(layout, rank, world, False)
    cls = DiesAsItReads if a.get("die") == rank else TieredReader
    reader = None
    try:
        reader = cls(cfg, spread=a.get("spread", True))
        if a.get("ring"):  # the device flow on the host: every tensor through a ring of 2 slots
            ring = Ring(Counting(), slots=2)
            reader._reads.ring_for = lambda device: ring
        dcp.load(target, storage_reader=reader)
        out = {"exact": exact(target, want), "error": None}
    except BaseException as e:  # noqa: BLE001 - reported, the test judges it
        out = {"exact": False, "error": describe(e)}
    out["failures"] = (
        [] if reader is None else [f.kind.name for fs in reader._reads.failures.values() for f in fs]
    )
    out["read"] = {} if reader is None or out["error"] else reader._reads.read_from
    out["groups"] = sorted(transport.OPENED)  # the pairs this rank opened a group with
    if a.get("ring") and reader is not None:
        tensors = sum(t.numel() * t.element_size() for t in target.values() if isinstance(t, torch.Tensor))
        out["ring"] = {"held": ring.held, "copied": ring.copier.copied, "tensor_bytes": tensors}
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
