"""The s3:// tier's own behaviour, on moto's S3 server (tests/s3_server.py) through s3fs.

The cases S3 shares with GCS (the store contract, faults, stalls, tiers, the CLI) run in
tests/test_gcs.py on both servers; request counts in tests/test_request_counts.py. Here:
what only S3 has (multipart uploads, bucket creation by s3fs) and its URL's backend.
"""

from __future__ import annotations

import os
import urllib.request

import pytest
from tiered_dcp.storage import FsspecStorage, PermanentStorageError, backend_for, check_url, open_storage

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[test]')")

MiB = 1 << 20
PARTS = {"default_block_size": 5 * MiB}  # s3fs uploads in parts of this size (S3's smallest)


def test_s3_urls_open_the_fsspec_backend(s3_bucket):
    assert backend_for("s3://b/x") is FsspecStorage and backend_for("s3a://b/x") is FsspecStorage
    check_url("s3://b/x")  # s3fs is installed: nothing to refuse
    with open_storage(f"{s3_bucket.url}/root", s3_bucket.storage_options) as store:
        assert isinstance(store, FsspecStorage)


def test_large_object_is_a_multipart_upload_and_a_failed_one_leaves_nothing(s3_bucket):
    with s3_bucket.proxy() as proxy:
        store = open_storage(f"{s3_bucket.url}/root", {**s3_bucket.via(proxy.url), **PARTS})
        data = os.urandom(12 * MiB + 5)
        assert store.write("step/rank_0.part", [data[: 7 * MiB], data[7 * MiB :]]) == len(data)
        kinds = proxy.reset_kinds()
        assert kinds.get("compose") == 1 and kinds.get("write", 0) >= 3, kinds  # begun, parts, completed
        assert store.read("step/rank_0.part") == data and store.list("step") == ["rank_0.part"]

        def chunks():
            yield os.urandom(6 * MiB)  # a part uploaded: the multipart upload is under way
            yield os.urandom(1 * MiB)
            raise RuntimeError("the source went away")

        with pytest.raises(RuntimeError, match="source went away"):
            store.write("step/rank_1.part", chunks())
        kinds = proxy.reset_kinds()
        assert kinds.get("write", 0) >= 2 and kinds.get("delete") == 1, kinds  # a part, then the abort
        assert store.size("step/rank_1.part") is None and store.list("step") == ["rank_0.part"]
    bucket = s3_bucket.url.removeprefix("s3://")
    with urllib.request.urlopen(f"{s3_bucket.server.url}/{bucket}?uploads", timeout=10) as r:
        assert b"<Upload>" not in r.read()  # no upload left holding parts (billed on AWS)


def test_a_write_to_a_missing_bucket_does_not_create_it(s3_server):
    store = open_storage("s3://never-made/root", s3_server.storage_options())
    with pytest.raises(PermanentStorageError, match="bucket does not exist"):
        store.write("k", [b"x"])
    with urllib.request.urlopen(f"{s3_server.url}/", timeout=10) as r:
        assert b"never-made" not in r.read()  # ListBuckets


def test_sizes_are_not_taken_from_a_stale_listing(s3_bucket):
    store = open_storage(f"{s3_bucket.url}/root", s3_bucket.storage_options)
    store.write("d/x", [b"1"])
    assert store.list_sizes("d") == {"x": 1}  # s3fs caches this listing
    # another process (a file system object of its own) adds an object and replaces one
    other = s3fs.S3FileSystem(skip_instance_cache=True, **s3_bucket.storage_options)
    root = f"{s3_bucket.url.removeprefix('s3://')}/root"
    other.pipe_file(f"{root}/d/y", b"22")
    other.pipe_file(f"{root}/d/x", b"333")
    assert store.size("d/y") == 2 and store.size("d/x") == 3 and store.exists("d/y")
