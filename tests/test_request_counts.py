"""Bucket requests that do not grow with the job: counted through a proxy in front of a real
fake-gcs-server, and of moto's S3 server (s3:// through s3fs), with real gloo ranks
(benchmarks/bench_requests.py's job, at 1 and 3 ranks).

Were every rank to look at every part again (an object-info call and an index read per part
and rank), the load's requests per rank would grow with the ranks; here rank 0 finds the
step and hands it to the others, so they fall. The load still agrees on one step, falls
back when a part is missing, and verifies every chunk (a damaged one is read from another
tier, or fails the load when none is left).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from tiered_dcp.storage import open_storage
from tiered_dcp.storage.format import part_key
from torch.distributed.checkpoint.api import CheckpointException

from tiered_dcp import NoCheckpointError, Tier, TieredConfig, TieredReader, TieredWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_requests import measure  # noqa: E402


@pytest.mark.parametrize("kind", ["local", "memory", "gcs", "s3"])
def test_list_sizes_names_objects_and_sizes_in_one_listing(kind, tmp_path, request):
    with contextlib.ExitStack() as stack:
        proxy = None
        if kind == "local":
            store = open_storage(str(tmp_path / "root"))
        elif kind == "memory":
            store = open_storage(f"memory://sizes-{os.getpid()}/root")
        else:
            bucket = request.getfixturevalue(f"{kind}_bucket")
            proxy = stack.enter_context(bucket.proxy())
            store = open_storage(f"{bucket.url}/root", bucket.via(proxy.url))
        store.write("d/b", [b"12345"])
        store.write("d/a", [b""])
        store.write("d/sub/c", [b"xy"])
        assert store.list_sizes("d") == {"a": 0, "b": 5}  # a sub-directory is no object here
        assert store.list_sizes("nothing") == {}
        assert [list(page) for page in store.list_pages("d")] == [["a", "b"]]
        if proxy is not None:
            proxy.reset_kinds()
            store.list_sizes("d")
            assert proxy.reset_kinds() == {"list": 1}


def per_rank(row: dict, op: str) -> float:
    return sum(row[op].values()) / row["ranks"]


@pytest.mark.parametrize("backend", ["gcs", "s3"])
def test_bucket_requests_per_rank_do_not_grow_with_the_ranks(backend, request):
    server = request.getfixturevalue({"gcs": "gcs_emulator", "s3": "s3_server"}[backend])
    one, three = measure(1, server), measure(3, server)
    for row in (one, three):
        load, save, n = row["load"], row["save"], row["ranks"]
        # load: one listing of the namespace and one of the step, no object-info call per part
        # (two: the lease's marker checks; on S3 a third, s3fs's rm asking after the lease's
        # key before deleting it), indexes and data read by the ranks needing them
        assert load.get("list", 0) <= 3 and load.get("info", 0) <= {"gcs": 2, "s3": 3}[backend], row
        assert load.get("read", 0) <= 2 + 4 * n, row  # marker, metadata; per rank <= 2 indexes, 2 items
        # save with persistence: one listing per writer, and retention's (writers finishing at
        # once may each commit: a listing and a marker read each); no index read back
        assert save.get("list", 0) <= 2 * n + 1 and save.get("info", 0) == 0 and save.get("read", 0) <= n, row
        # nothing asks after the bucket itself (s3fs's makedirs did, before every write)
        assert "bucket" not in save and "bucket" not in load, row
    assert per_rank(one, "load") <= {"gcs": 12, "s3": 13}[backend] and per_rank(one, "save") <= 30
    assert per_rank(three, "load") <= per_rank(one, "load")  # what rank 0 does for all spreads out
    assert per_rank(three, "save") <= 1.25 * per_rank(one, "save")


def _state(step: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(64 * 40, dtype=torch.float32).reshape(64, 40) + 1000 * step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def _load(cfg: TieredConfig, mesh) -> tuple[int, list[int], int, torch.Tensor]:
    """(step, tiers, items read from a second source on this rank, the whole tensor)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    target = {"w": distribute_tensor(torch.zeros(64, 40), mesh, [Shard(0)]), "step": -1}
    reader = TieredReader(cfg)
    dcp.load(target, storage_reader=reader)
    assert target["step"] == reader.step
    return reader.step, reader.tiers, len(reader._reads.failures), target["w"].full_tensor()


def _flip_a_byte(store, key: str) -> None:
    data = bytearray(store.read(key))
    data[len(data) // 2] ^= 0xFF
    store.write(key, [bytes(data)])


def _missing_and_damaged(rank, world, url_a, url_b, options):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    a, b = Tier(url_a, storage_options=options), Tier(url_b, storage_options=options)
    for step in (1, 2):
        dcp.save(_state(step, mesh), storage_writer=TieredWriter(TieredConfig("job", [a]), step=step))
    dcp.save(_state(1, mesh), storage_writer=TieredWriter(TieredConfig("job", [b]), step=1))
    cfg = TieredConfig("job", [a, b])
    store_a, store_b = open_storage(url_a, options), open_storage(url_b, options)
    out = []
    for harm in (None, "part gone", "chunk damaged on a", "chunk damaged on b too"):
        dist.barrier()
        if rank == 0 and harm == "part gone":  # step 2 on a lacks rank 1's part: step 1 is loaded
            store_a.delete(part_key("job", 2, 1))
        if rank == 0 and harm == "chunk damaged on a":  # rank 1's rows come from b
            _flip_a_byte(store_a, part_key("job", 1, 1))
        if rank == 0 and harm == "chunk damaged on b too":  # no good copy of rank 1's rows left
            _flip_a_byte(store_b, part_key("job", 1, 1))
        dist.barrier()
        try:
            step, tiers, failures, w = _load(cfg, mesh)
        except CheckpointException as e:
            out.append(("failed", "no good copy of item 'w'" in str(e)))
            continue
        assert torch.equal(w, _state(step, mesh)["w"].full_tensor())
        out.append((step, tiers, failures))
    return out


def test_load_agrees_falls_back_and_verifies_with_rank_0_finding_the_step(bucket):
    options = dict(bucket.storage_options)
    url_a, url_b = f"{bucket.url}/a", f"{bucket.url}/b"
    results = run_ranks(_missing_and_damaged, 2, url_a, url_b, options, env={"LOCAL_WORLD_SIZE": 1})
    steps = [[r[0] for r in rank] for rank in results]
    assert steps == [[2, 1, 1, "failed"]] * 2  # every rank the same step, each time
    assert results[0][0] == (2, [0], 0) and results[0][1] == (1, [0, 1], 0)  # b holds step 1 only
    assert results[1][2] == (1, [0, 1], 1)  # rank 1's item: damaged on a, read from b
    assert results[0][2] == (1, [0, 1], 0)
    assert results[0][3] == results[1][3] == ("failed", True)


def _first_load(rank, world, local, url, options):
    """A job's first ``TieredReader`` with nothing saved yet: its error, on this rank."""
    cfg = TieredConfig("fresh", [Tier(f"{local}/{{node}}"), Tier(url, shared=True, storage_options=options)])
    with pytest.raises(NoCheckpointError) as e:
        TieredReader(cfg).open()  # with a group, the step is chosen here (load_latest's call)
    return str(e.value)


def test_a_first_load_with_nothing_saved_asks_the_bucket_once(bucket, tmp_path):
    """A job starting with no checkpoint (every run's first ``load_latest``): rank 0 lists the
    bucket once and no rank searches again, nor lists the bucket to word its error; at
    10,000 ranks the retries and the errors' listings would be ~60,000 requests. Every
    rank's error names the tiers searched."""
    with bucket.proxy() as proxy:
        options = bucket.via(proxy.url)
        proxy.reset_kinds()
        errors = run_ranks(
            _first_load, 3, str(tmp_path / "ram"), f"{bucket.url}/fresh", options, env={"LOCAL_WORLD_SIZE": 1}
        )
        asked = proxy.reset_kinds()
    assert asked == {"list": {"gcs": 1, "s3": 2}[bucket.kind]}, asked  # one listing (s3fs: 2 requests)
    for rank, error in enumerate(errors):
        assert "no complete checkpoint of namespace 'fresh'" in error, error
        lines = {ln.split(" [")[0].strip(): ln for ln in error.splitlines() if ln.startswith("  tier ")}
        assert "complete steps none" in lines["tier 0"], error
        expected = "complete steps none" if rank == 0 else "searched by rank 0"
        assert expected in lines["tier 1"], error


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
