"""Bucket tiers against real servers: gs:// (tiered-dcp's own GCS backend) on fake-gcs-server
(tests/gcs_emulator.py) and, for every test taking the ``bucket`` fixture, s3:// (s3fs through
the fsspec backend) on moto's S3 server (tests/s3_server.py) too.

Faults come from a FaultProxy in front of the server: HTTP error answers, dropped
connections, a bucket that accepts connections and never answers; a dead endpoint is a
loopback port nobody listens on. Tests of the GCS backend's own machinery (parallel pieces
and compose, ranged reads split across requests, its options) take ``gcs_bucket`` only;
tests/test_s3.py has the S3 backend's own (multipart uploads).
"""

from __future__ import annotations

import errno
import os
import socket
import time

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import assert_state_equal, settle, value_kinds, zeros_like_state
from dist_utils import run_ranks
from gcs_emulator import FaultProxy
from test_save_load import load, save
from tiered_dcp.storage import (
    FsspecStorage,
    GCSStorage,
    PermanentStorageError,
    StorageError,
    TransientStorageError,
    backend_for,
    open_storage,
)

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, export, latest_step, status, wait_for
from tiered_dcp.ops.verify import verify_step

KiB, MiB = 1 << 10, 1 << 20
# small pieces, so that the test states (a 12 MiB item) are uploaded as composed pieces on
# GCS, and as a multipart upload (5 MiB parts, S3's smallest) on S3
SMALL_PIECES = {"part_size": 1 * MiB, "max_concurrency": 4}
PIECES = {"gcs": SMALL_PIECES, "s3": {"default_block_size": 5 * MiB}}
QUICK_FAILURE = {"idle_timeout": 1.0, "retry_timeout": 2.0}
BACKEND = {"gcs": GCSStorage, "s3": FsspecStorage}


def chunked(data: bytes, size: int) -> list[memoryview]:
    view = memoryview(data)
    return [view[i : i + size] for i in range(0, len(data), size)]


def store_on(bucket, endpoint: str | None = None, root: str = "root", **options) -> GCSStorage:
    so = bucket.via(endpoint) if endpoint else bucket.storage_options
    store = open_storage(f"{bucket.url}/{root}", {**so, **options})
    assert isinstance(store, BACKEND[bucket.kind])
    return store  # type: ignore[return-value]  # an FsspecStorage on S3


# ---- the backend ----------------------------------------------------------------------------


def test_gs_and_gcs_urls_open_the_gcs_backend():
    assert backend_for("gs://b/x") is GCSStorage and backend_for("gcs://b/x") is GCSStorage


def test_store_interface_on_the_server(bucket):
    store = store_on(bucket)
    assert store.list("a") == [] and store.size("a/b/x") is None
    assert store.write("a/b/x", [b"hello ", memoryview(b"world")]) == 11
    assert store.size("a/b/x") == 11 and store.read("a/b/x") == b"hello world"
    assert store.read("a/b/x", 6) == b"world" and store.read("a/b/x", 2, 3) == b"llo"
    assert store.read("a/b/x", 11) == b"" and store.read("a/b/x", 8, 100) == b"rld"
    out = bytearray(5)
    store.read_into("a/b/x", 6, memoryview(out))
    assert out == b"world"
    with pytest.raises(OSError, match="ends 2 bytes early|short read") as e:
        store.read_into("a/b/x", 8, memoryview(bytearray(5)))
    assert not isinstance(e.value, StorageError)  # a short object is damage, not a failing bucket
    store.write("a/b/empty", [b""])
    store.write("a/b/with space", [])
    assert store.size("a/b/empty") == 0 and store.read("a/b/empty") == b""
    assert store.list("a/b") == ["empty", "with space", "x"] and store.list("a") == ["b"]
    store.write("a/b/x", [b"new"])  # overwrite
    assert store.read("a/b/x") == b"new"
    store.delete("a/b/x")
    assert store.list("a/b") == ["empty", "with space"]
    store.delete("a")
    assert store.list("") == [] and store.size("a/b/empty") is None
    store.delete("never-there")


def test_missing_keys_are_file_not_found(bucket):
    store = store_on(bucket)
    for call in (
        lambda: store.read("no/such"),
        lambda: store.read_into("no/such", 0, memoryview(bytearray(4))),
    ):
        with pytest.raises(FileNotFoundError) as e:
            call()
        assert not isinstance(e.value, StorageError) and "no/such" in str(e.value)
    assert store.size("no/such") is None and store.list("no") == []


def test_large_object_is_uploaded_in_parallel_pieces_and_composed(gcs_bucket, fault_proxy):
    # 70 pieces: more than one compose request can name (32), so the compose is two levels
    data = os.urandom(70 * 64 * KiB + 123)
    store = store_on(gcs_bucket, fault_proxy.url, part_size=64 * KiB, max_concurrency=6)
    fault_proxy.gather(2, "write")  # the first piece is held unanswered until a second comes
    assert store.write("step/rank_0.part", chunked(data, 100_000)) == len(data)
    assert fault_proxy.gathered == 2, "pieces were not uploaded concurrently"
    assert store.list("step") == ["rank_0.part"]  # the pieces are gone: only the object is left
    assert store.size("step/rank_0.part") == len(data)
    assert store.read("step/rank_0.part") == data
    # a ranged read is split into concurrent ranged GETs, each landing in its own slice
    out = bytearray(8 * MiB)
    big = os.urandom(9 * MiB)
    store.write("big", [big])
    fault_proxy.gather(2, "read")
    store.read_into("big", 1000, memoryview(out))
    assert out == big[1000 : 1000 + 8 * MiB] and fault_proxy.gathered == 2


def test_failed_ranged_read_leaves_no_range_writing(gcs_bucket, fault_proxy, monkeypatch):
    """A ranged GET is refused while the read's other ranges are in flight (the proxy never
    answers them): ``read_into`` raises only once each of them has stopped, so none goes on
    writing into the buffer its caller has given up on."""
    store = store_on(gcs_bucket, fault_proxy.url, max_concurrency=8)
    store.write("big", [os.urandom(8 * MiB)])
    running: set[int] = set()  # the ranges (by offset) whose GET has not ended
    get_range = GCSStorage._get_range

    async def tracked(self, name: str, offset: int, view: memoryview) -> int:
        running.add(offset)
        try:
            return await get_range(self, name, offset, view)
        finally:
            running.discard(offset)

    monkeypatch.setattr(GCSStorage, "_get_range", tracked)
    fault_proxy.inject(("403", 2), ("stall", 1))  # of the 8 ranged GETs, the 2nd, 4th... refused
    with pytest.raises(PermanentStorageError, match="HTTP 403"):
        store.read_into("big", 0, memoryview(bytearray(8 * MiB)))
    assert fault_proxy.counts["stall"] >= 1  # the 1st was in flight, unanswered, at the refusal
    assert not running, f"ranges still running after read_into raised: {sorted(running)}"


def test_failed_upload_leaves_no_object(gcs_bucket, fault_proxy):
    store = store_on(gcs_bucket, fault_proxy.url, part_size=64 * KiB, max_concurrency=4)

    def chunks():
        yield os.urandom(1 * MiB)  # pieces on their way (through the proxy: not instantly)
        raise RuntimeError("the source went away")

    with pytest.raises(RuntimeError, match="source went away"):
        store.write("d/part", chunks())
    assert fault_proxy.counts["pass"] >= 4  # pieces were being uploaded
    # a piece the server was still storing when the write gave up lands before its answer
    # passes the proxy: once every request the proxy took has ended, none lands later
    deadline = time.monotonic() + 60
    while not fault_proxy.idle():
        assert time.monotonic() < deadline, "requests still in flight through the proxy"
        time.sleep(0.01)
    assert store.size("d/part") is None  # never a partial object under the key
    # the write's pieces were deleted; one the server stored after that deletion (a race no
    # client can close) lies only under the scratch prefix, which deleting the step removes
    leftovers = store.list("d")
    assert all(n.startswith("part.compose-") for n in leftovers), leftovers
    store.delete("d")
    assert store.list("d") == []


def test_missing_bucket_fails_at_once_and_says_so(bucket):
    url = f"{bucket.kind.replace('gcs', 'gs')}://no-such-bucket/root"
    store = open_storage(url, bucket.storage_options)
    calls = {
        "write": lambda: store.write("k", [b"x"]),
        "read": lambda: store.read("k"),
        "size": lambda: store.size("k"),
        "list": lambda: store.list(""),
    }
    for name, call in calls.items():
        started = time.monotonic()
        with pytest.raises(PermanentStorageError, match="[bB]ucket( 'no-such-bucket')? does not exist") as e:
            call()
        assert time.monotonic() - started < 2, name
        assert e.value.errno == errno.ENOENT and url in str(e.value)
    # ... and the write did not create it (s3fs's makedirs creates a bucket that is missing)
    with pytest.raises(PermanentStorageError, match="does not exist"):
        store.list("")


def test_forbidden_is_permanent_and_not_retried(bucket, proxy):
    store = store_on(bucket, proxy.url)
    proxy.inject(("403", 1))
    words = {"gcs": "access denied .*HTTP 403.*credentials", "s3": "access denied: Forbidden"}
    with pytest.raises(PermanentStorageError, match=words[bucket.kind]) as e:
        store.write("k", [b"x"])
    assert e.value.errno == errno.EACCES
    assert proxy.counts == {"403": 1}  # one request: no retry


@pytest.mark.parametrize("fault", ["503", "429", "drop"])
def test_transient_failures_are_retried(bucket, proxy, fault):
    if bucket.kind == "s3" and fault == "429":
        pytest.skip("S3 throttles with 503 SlowDown; botocore does not retry a bare 429")
    # many requests: pieces on GCS, a multipart upload's parts on S3 (5 MiB at least)
    options = {"gcs": {"part_size": 64 * KiB, "max_concurrency": 4}, "s3": PIECES["s3"]}[bucket.kind]
    store = store_on(bucket, proxy.url, **options)
    data = os.urandom({"gcs": 10 * 64 * KiB, "s3": 16 * MiB}[bucket.kind])
    proxy.inject((fault, 3))
    store.write("p", chunked(data, 50_000 if bucket.kind == "gcs" else 4 * MiB))
    assert store.read("p") == data and store.size("p") == len(data) and store.list("") == ["p"]
    store.delete("p")
    assert store.size("p") is None
    assert proxy.counts[fault] >= 3, proxy.counts


def test_stalled_bucket_times_out_within_the_bound(bucket, proxy):
    store = open_storage(f"{bucket.url}/root", bucket.quick(proxy.url))
    store.write("k", [b"x"])
    proxy.inject(("stall", 1))  # connections accepted, never answered
    calls = [lambda: store.write("k", [b"y" * 300_000]), lambda: store.read("k"), lambda: store.list("")]
    if bucket.kind == "s3":
        # the upload: botocore's "Expect: 100-continue" made it wait forever. ~15 s a call (s3fs
        # tries 5 times, botocore twice each; a read's tries are nested in 5 more): one call
        calls = calls[:1]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(TransientStorageError, match="idle_timeout.*gave up after|Read timeout") as e:
            call()
        # GCS: idle 1 s per attempt, no retry after 2 s; S3: 10 tries of 1 s, backoff between
        assert time.monotonic() - started < {"gcs": 6, "s3": 25}[bucket.kind]
        assert e.value.errno == errno.ETIMEDOUT or bucket.kind == "s3"  # botocore's has none
    assert proxy.counts["stall"] >= {"gcs": 6, "s3": 5}[bucket.kind]


def test_dead_endpoint_is_transient_within_the_bound(bucket):
    with socket.socket() as s:  # bound, not listening: every connection is refused
        s.bind(("127.0.0.1", 0))
        store = open_storage(f"{bucket.url}/root", bucket.quick(f"http://127.0.0.1:{s.getsockname()[1]}"))
        started = time.monotonic()
        words = {"gcs": "gave up after [2-9] attempt", "s3": "Could not connect to the endpoint"}
        with pytest.raises(TransientStorageError, match=words[bucket.kind]) as e:
            store.write("k", [b"x"])
        assert time.monotonic() - started < 5
        assert e.value.errno == errno.ECONNREFUSED or bucket.kind == "s3"  # botocore's has none


# ---- tiers on gs:// -------------------------------------------------------------------------


def gs_tier(bucket, root="ckpt", options=None, **kw) -> Tier:
    """A tier on ``bucket`` (gs:// or s3://, despite the name)."""
    return Tier(f"{bucket.url}/{root}", storage_options={**bucket.storage_options, **(options or {})}, **kw)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_roundtrip_every_value_kind(bucket, compression):
    cfg = TieredConfig("run", [gs_tier(bucket, options=PIECES[bucket.kind], compression=compression)])
    save(cfg, 3)
    reader, got = load(cfg)
    assert (reader.step, reader.tiers) == (3, [0])
    assert_state_equal(got, value_kinds(3))
    store = store_on(bucket, root="ckpt")
    names = store.list("run/step_000000000003")
    # no upload pieces left behind; format 3 keeps each part's JSON index next to it
    assert names == ["COMMITTED", "metadata", "rank_00000.index", "rank_00000.part"]
    assert store.size("run/step_000000000003/rank_00000.part") > 12 * MiB or compression == "zstd"


def test_schedule_and_retention_with_a_bucket_tier(bucket, tmp_path):
    cfg = TieredConfig(
        "run",
        [
            Tier(str(tmp_path / "ram" / "{node}"), every=1, keep=2),
            gs_tier(bucket, options=PIECES[bucket.kind], every=2, keep=2, compression="zstd"),
        ],
    )
    for step in range(7):
        save(cfg, step)
    settle(cfg)  # the writer process copied the even steps into the bucket
    held = {}
    for row in status(cfg):
        assert row.state == "committed"
        held.setdefault(row.tier_index, []).append(row.step)
    assert held == {0: [5, 6], 1: [4, 6]}
    assert store_on(bucket, root="ckpt").list("run") == ["step_000000000004", "step_000000000006"]
    reader, got = load(cfg, step=4)
    assert reader.tiers == [1]  # RAM no longer holds it: read from the bucket
    assert_state_equal(got, value_kinds(4))
    assert latest_step(TieredConfig("run", [cfg.tiers[1]])) == 6
    (check,) = verify_step(cfg, 4)  # the zstd copy the writer process made, read back from the bucket
    assert check.tier_index == 1 and check.ok and check.items > 0


def test_flaky_bucket_ends_with_every_step_committed(bucket, tmp_path, proxy):
    flaky = {**bucket.via(proxy.url), **PIECES[bucket.kind]}
    cfg = TieredConfig(
        "run",
        [
            Tier(str(tmp_path / "ram" / "{node}"), keep=1),
            Tier(f"{bucket.url}/ckpt", storage_options=flaky, compression="zstd"),
        ],
    )
    proxy.inject(("503", 4), ("drop", 5))
    for step in range(1, 4):
        save(cfg, step)
    settle(cfg)
    assert proxy.counts.get("503", 0) >= 3 and proxy.counts.get("drop", 0) >= 3, proxy.counts
    bucket_only = TieredConfig("run", [gs_tier(bucket)])  # straight to the server
    assert [(r.step, r.state) for r in status(bucket_only)] == [(s, "committed") for s in (1, 2, 3)]
    for step in (1, 2, 3):
        _, got = load(bucket_only, step=step)
        assert_state_equal(got, value_kinds(step))


def test_export_and_verify_from_the_bucket(bucket, tmp_path):
    raw = TieredConfig("run", [gs_tier(bucket, options=PIECES[bucket.kind])])
    save(raw, 2)
    dest = export(raw, 2, tmp_path / "exported")
    got = zeros_like_state(value_kinds(0))
    dcp.load(got, storage_reader=dcp.FileSystemReader(dest))
    assert_state_equal(got, value_kinds(2))
    (check,) = verify_step(raw, 2)
    assert check.ok and check.items > 0 and check.bytes_read > 12 * MiB
    # flip one byte of the stored part in the bucket: verify names the damaged item
    store = store_on(bucket, root="ckpt")
    key = "run/step_000000000002/rank_00000.part"
    data = bytearray(store.read(key))
    data[int(len(data) * 0.9)] ^= 0x5A
    store.write(key, [data])
    (check,) = verify_step(raw, 2)
    assert not check.ok and any("nested.big" in p and key in p for p in check.problems), check.problems


def test_zstd_bucket_verifies_when_it_is_the_only_tier(bucket):
    cfg = TieredConfig("run", [gs_tier(bucket, compression="zstd")])
    save(cfg, 1)
    (check,) = verify_step(cfg, 1)
    assert check.ok and check.items > 0


# ---- several ranks --------------------------------------------------------------------------


def full(step: int) -> torch.Tensor:
    return torch.arange(64 * 40, dtype=torch.float32).reshape(64, 40) + 1000 * step


def _sharded(step: int, mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"w": distribute_tensor(full(step), mesh, [Shard(0)]), "step": step}


def _rank_config(root: str, url: str, options: dict) -> TieredConfig:
    return TieredConfig(
        "job",
        [
            Tier(f"{root}/ram/{{node}}", every=1, keep=2),
            Tier(url, every=2, keep=2, storage_options=options, compression="zstd"),
        ],
    )


def _load_sharded(cfg: TieredConfig) -> tuple[int, list[int], torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    target = {"w": distribute_tensor(torch.zeros(64, 40), mesh, [Shard(0)]), "step": -1}
    reader = TieredReader(cfg)
    dcp.load(target, storage_reader=reader)
    assert target["step"] == reader.step
    return reader.step, reader.tiers, target["w"].full_tensor()


def _two_ranks(rank, world, root, url, options):
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    # the bucket as the fastest tier: the coordinator commits the shared step there
    direct = TieredConfig("direct", [Tier(url, storage_options=options)])
    dcp.save(_sharded(1, mesh), storage_writer=TieredWriter(direct, step=1))
    step, tiers, w = _load_sharded(direct)
    assert (step, tiers) == (1, [0]) and torch.equal(w, full(1))
    # the bucket behind a node-local tier: the ranks' writer processes fill it, the last commits
    cfg = _rank_config(root, url, options)
    for step in range(1, 5):
        dcp.save(_sharded(step, mesh), storage_writer=TieredWriter(cfg, step=step))
    wait_for(cfg, 4, tier=1, timeout=60)
    intact = _load_sharded(cfg)
    assert intact[:2] == (4, [0, 1]) and torch.equal(intact[2], full(4))  # RAM first, then the bucket
    # node 1 is lost with its RAM tier: step 4 is loaded, by both ranks, from the bucket
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/ram/1")
    dist.barrier()
    after = _load_sharded(cfg)
    assert torch.equal(after[2], full(4))
    return after[:2]


def test_two_ranks_commit_shared_steps_and_fall_back_to_the_bucket_after_node_loss(bucket, tmp_path):
    url = f"{bucket.url}/ckpt"
    options = {**bucket.storage_options, **PIECES[bucket.kind]}
    results = run_ranks(_two_ranks, 2, str(tmp_path), url, options, env={"LOCAL_WORLD_SIZE": 1})
    assert results == [(4, [1]), (4, [1])]
    store = store_on(bucket, root="ckpt")
    assert store.list("direct") == ["step_000000000001"]
    assert store.list("job") == ["step_000000000002", "step_000000000004"]
    assert store.list("job/step_000000000004") == [
        "COMMITTED",
        "metadata",
        "rank_00000.index",
        "rank_00000.part",
        "rank_00001.index",
        "rank_00001.part",
    ]


def test_cli_verify_reads_the_bucket(bucket):
    import sys

    cfg = TieredConfig("run", [gs_tier(bucket)])
    save(cfg, 5)
    options = [f"--option={k}={v}" for k, v in bucket.storage_options.items()]
    r = preloaded.run(
        [sys.executable, "-m", "tiered_dcp.cli", "verify", "-n", "run", *options, f"{bucket.url}/ckpt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.count(": OK") == 1, r.stdout + r.stderr


def test_fault_proxy_stops_by_itself(gcs_emulator):
    proxy = FaultProxy(gcs_emulator.url, lifetime=0.5)
    proxy.inject(("stall", 1))
    proxy._thread.join(timeout=30)  # its accept loop ends at its lifetime, closing the port
    assert not proxy._thread.is_alive(), "the proxy is still serving after its lifetime"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])), 1):
        pass


def test_backend_options_are_taken_out_of_storage_options_and_checked():
    from tiered_dcp.storage.gcs_store import GCSOptions

    opts, rest = GCSOptions.split({"part_size": "65536", "idle_timeout": "2.5", "token": "anon"})
    assert (opts.part_size, opts.idle_timeout, opts.max_concurrency) == (65536, 2.5, 8)
    assert rest == {"token": "anon"}  # everything else goes to gcsfs
    with pytest.raises(ValueError, match="part_size='x' is not a number"):
        GCSOptions.split({"part_size": "x"})
    with pytest.raises(ValueError, match="must be >= 1"):
        GCSOptions.split({"max_concurrency": 0})
