"""A whole job restarting from a bucket: each stored byte read once and spread, or read by
every replica (today's way before the spread), in the same run.

    .venv/bin/python benchmarks/bench_restore.py [--jobs 4x2 8x4] [--mib 256] [--loads 3]

For each job ``WxD`` (W ranks, 2 per simulated node, D data-parallel replicas): W real
processes on gloo save a model of ``--mib`` MiB as HSDP DTensors on a (D replicas, W/D
shards) mesh to a bucket on fake-gcs-server (one copy of each shard is stored), then, with
no node-local tier (a job restarted on new nodes), load it ``--loads`` times each way,
taking turns: ``TieredReader(config, spread=False)`` and the default spread. Every load is
checked exact on every rank. Printed per job and way: the median load time (the slowest
rank's, reader construction included) and the bytes the bucket served (counted by a
FaultProxy in rank 0's process, every rank's requests going through it) as a ratio of the
step's stored size. Never fails on timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from common import slowest, spawn_ranks  # noqa: E402
from gcs_emulator import Emulator, FaultProxy  # noqa: E402
from tiered_dcp.storage import open_storage  # noqa: E402
from tiered_dcp.storage.format import step_dir  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown  # noqa: E402

MiB = 1 << 20
LAYERS = 8
RANKS_PER_NODE = 2


def model(mib: int, world: int, replicas: int, empty: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    rows = mib * MiB // LAYERS // 4 // 1024
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(LAYERS):
        full = torch.zeros(rows, 1024) if empty else torch.randn(rows, 1024, generator=g)
        out[f"layer{i}"] = distribute_tensor(full, mesh, [Replicate(), Shard(0)])
    return out


def rank_main(rank: int, world: int, a: dict) -> dict:
    """One rank: save the model once, then time each way of loading it, and what the bucket
    served (rank 0 runs the counting proxy)."""
    proxy = FaultProxy(a["emulator"], lifetime=1200) if rank == 0 else None
    box = [proxy.url if proxy else None]
    dist.broadcast_object_list(box, src=0)
    options = {"endpoint_url": box[0], "token": "anon", "project": a["project"]}
    cfg = TieredConfig("restore", [Tier(a["url"], shared=True, storage_options=options)])
    want = model(a["mib"], world, a["replicas"], False)
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    shutdown()
    times: dict[str, list[float]] = {"each": [], "spread": []}
    served: dict[str, list[int]] = {"each": [], "spread": []}
    for _ in range(a["loads"]):
        for way in ("each", "spread"):
            target = model(a["mib"], world, a["replicas"], True)
            dist.barrier()
            if proxy is not None:
                proxy.served = 0
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=TieredReader(cfg, spread=way == "spread"))
            times[way].append(slowest(time.perf_counter() - t0))
            if proxy is not None:
                served[way].append(proxy.served)
            if not all(torch.equal(target[k].to_local(), want[k].to_local()) for k in want):
                raise AssertionError(f"a {way} load was not exact on rank {rank}")
    dist.barrier()  # every rank's loads are through the proxy
    if proxy is not None:
        proxy.stop()
    return {"times": times, "served": served}


def run_job(world: int, replicas: int, em: Emulator, args: argparse.Namespace) -> dict:
    name = f"restore-{uuid.uuid4().hex[:8]}"
    em.create_bucket(name)
    a = {"emulator": em.url, "project": em.storage_options()["project"], "url": f"gs://{name}"}
    a.update(mib=args.mib, loads=args.loads, replicas=replicas)
    out = spawn_ranks(rank_main, world, world, a, env={"LOCAL_WORLD_SIZE": RANKS_PER_NODE})
    with open_storage(a["url"], em.storage_options()) as store:
        stored = sum(store.list_sizes(step_dir("restore", 1)).values())
    row = {"stored_mib": stored / MiB}
    for way in ("each", "spread"):
        row[f"{way}_load_s"] = statistics.median(out[0]["times"][way])
        row[f"{way}_served_vs_stored"] = statistics.median(out[0]["served"][way]) / stored
    row["spread_time_vs_each"] = row["spread_load_s"] / row["each_load_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", nargs="+", default=["4x2", "8x4"], help="WORLDxREPLICAS (default 4x2 8x4)")
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB (default 256)")
    ap.add_argument("--loads", type=int, default=3, help="loads of each way (default 3)")
    args = ap.parse_args()
    rows = {}
    with Emulator() as em:
        for spec in args.jobs:
            world, replicas = map(int, spec.split("x"))
            rows[spec] = run_job(world, replicas, em, args)
    print(f"restore of a {args.mib} MiB HSDP model from a bucket, {RANKS_PER_NODE} ranks per node")
    print(
        f"{'job':<6}{'each s':>8}{'spread s':>10}{'time ratio':>11}{'served each':>13}{'served spread':>15}"
    )
    for spec, r in rows.items():
        print(
            f"{spec:<6}{r['each_load_s']:>8.2f}{r['spread_load_s']:>10.2f}{r['spread_time_vs_each']:>11.2f}"
            f"{r['each_served_vs_stored']:>12.2f}x{r['spread_served_vs_stored']:>14.2f}x"
        )
    print(json.dumps({"bench": "restore", "mib": args.mib, "loads": args.loads, "jobs": rows}))


if __name__ == "__main__":
    main()
