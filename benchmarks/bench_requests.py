"""Bucket requests per rank for one save (with persistence) and one load, at 1, 2, 4, 8 ranks.

    .venv/bin/python benchmarks/bench_requests.py [--ranks 1 2 4 8] [--backend gcs s3] [--json]

Every request reaches the bucket's server (fake-gcs-server for gs://, moto's S3 server for
s3:// through s3fs) through a counting proxy (tests/gcs_emulator.py's FaultProxy, passing
everything), classified as list / info / read / write / compose / delete / bucket (on S3:
a multipart upload's parts are writes and its completion a compose). The job: N ranks on
gloo, each its own node, tiers ``[RAM node-local every=1, gs:// or s3:// every=1]``; the
state is two items (a DTensor sharded over the ranks, and an int). Save: one ``dcp.save``
committed on RAM, then each rank's writer process copies its part to the bucket and the
last one commits it there; the ranks wait on their writers' local queues (nothing here
polls the bucket). Load: every rank loads the step from a config whose only tier is the
bucket. Prints requests per rank by kind; flat per-rank figures mean the bucket's load
grows linearly with the job. docs/scale.md
holds the measured table and its extrapolation to 1,000 and 10,000 ranks;
tests/test_request_counts.py runs ``measure`` at 1 and 3 ranks and asserts the bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from common import own_runtime_dir  # noqa: E402
from dist_utils import run_ranks  # noqa: E402
from gcs_emulator import Emulator, FaultProxy  # noqa: E402
from s3_server import MotoServer, s3_request_kind  # noqa: E402

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, writer_status  # noqa: E402

own_runtime_dir("tdcp-bench-rt-")  # every rank imports this module: only the first makes one
warnings.filterwarnings("ignore")
KINDS = ("list", "info", "read", "write", "compose", "delete", "bucket", "other")


def _config(root: str, url: str, options: dict, with_ram: bool) -> TieredConfig:
    bucket = Tier(url, storage_options=options)
    return TieredConfig("req", [Tier(f"{root}/ram/{{node}}"), bucket] if with_ram else [bucket])


def _full(world: int) -> torch.Tensor:
    return torch.arange(world * 64 * 256, dtype=torch.float32).reshape(world * 64, 256)


def _save(rank: int, world: int, root: str, url: str, options: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    cfg = _config(root, url, options, with_ram=True)
    state = {"w": distribute_tensor(_full(world), mesh, [Shard(0)]), "step": 1}
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    deadline = time.monotonic() + 120
    while any(w.queue for w in writer_status(cfg) if w.rank == rank):  # local files only
        assert time.monotonic() < deadline, "the writer did not finish"
        time.sleep(0.05)
    dist.barrier()


def _load(rank: int, world: int, root: str, url: str, options: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    target = {"w": distribute_tensor(torch.zeros(world * 64, 256), mesh, [Shard(0)]), "step": -1}
    dcp.load(target, storage_reader=TieredReader(_config(root, url, options, with_ram=False)))
    assert target["step"] == 1 and torch.equal(target["w"].full_tensor(), _full(world))


def measure(world: int, server: Emulator | MotoServer) -> dict:
    """Requests by kind for one save and one load by ``world`` ranks, on a fresh bucket of
    ``server`` (fake-gcs-server: gs://, moto: s3://)."""
    bucket = f"req-{world}-{os.getpid()}"
    server.create_bucket(bucket)
    s3 = isinstance(server, MotoServer)
    kind = s3_request_kind if s3 else None
    with FaultProxy(server.url, kind=kind) as proxy, tempfile.TemporaryDirectory() as root:
        url, options = f"{'s3' if s3 else 'gs'}://{bucket}/ckpt", server.storage_options(proxy.url)
        env = {"LOCAL_WORLD_SIZE": 1}
        run_ranks(_save, world, root, url, options, env=env)
        save = proxy.reset_kinds()
        run_ranks(_load, world, root, url, options, env=env)
        load = proxy.reset_kinds()
    return {"backend": "s3" if s3 else "gcs", "ranks": world, "save": save, "load": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--backend", nargs="+", choices=["gcs", "s3"], default=["gcs"])
    ap.add_argument("--json", action="store_true", help="print the counts as JSON too")
    args = ap.parse_args()
    rows = []
    for backend in args.backend:
        with Emulator() if backend == "gcs" else MotoServer() as server:
            for world in args.ranks:
                rows.append(measure(world, server))
    print(f"{'bucket':<6} {'ranks':>5}  {'op':<5} {'per rank':>9}  " + " ".join(f"{k:>7}" for k in KINDS))
    for r in rows:
        for op in ("save", "load"):
            counts = r[op]
            total = sum(counts.values())
            cells = " ".join(f"{counts.get(k, 0) / r['ranks']:>7.1f}" for k in KINDS)
            print(f"{r['backend']:<6} {r['ranks']:>5}  {op:<5} {total / r['ranks']:>9.1f}  {cells}")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    import bench_requests  # the ranks unpickle _save and _load by this module's name, not __main__'s

    bench_requests.main()
