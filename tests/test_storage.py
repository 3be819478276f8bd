import os

import pytest
from conftest import fd_table
from tiered_dcp.storage import FsspecStorage, LocalStorage
from tiered_dcp.storage.codec import (
    ChecksumMismatch,
    Encoder,
    checksum,
    decode_into,
    make_record,
    split,
    verify_stored,
)
from tiered_dcp.storage.format import ItemInfo
from tiered_dcp.storage.local import needs_fsync


@pytest.fixture(params=["local", "fsspec-file", "fsspec-memory"])
def store(request, tmp_path):
    if request.param == "local":
        s = LocalStorage(str(tmp_path / "root"))
    elif request.param == "fsspec-file":
        s = FsspecStorage(f"file://{tmp_path}/root")
    else:
        s = FsspecStorage(f"memory://tdcp-test-{os.getpid()}-{id(request)}/root")
    yield s
    s.delete("")


def test_storage_interface(store):
    assert store.list("a") == []
    assert store.size("a/b/x") is None
    n = store.write("a/b/x", [b"hello ", memoryview(b"world")])
    assert n == 11 and store.size("a/b/x") == 11
    assert store.read("a/b/x") == b"hello world"
    assert store.read("a/b/x", 6, 5) == b"world"
    out = bytearray(5)
    store.read_into("a/b/x", 0, memoryview(out))
    assert out == b"hello"
    store.write("a/b/y", [b""])
    assert store.list("a/b") == ["x", "y"]
    store.write("a/b/x", [b"new"])  # overwrite
    assert store.read("a/b/x") == b"new"
    store.delete("a/b/x")
    assert store.list("a/b") == ["y"]
    store.delete("a")
    assert store.list("a") == []
    store.delete("never-there")


def test_local_write_failure_leaves_nothing(tmp_path):
    store = LocalStorage(str(tmp_path))

    def chunks():
        yield b"x" * 100
        raise RuntimeError("trainer died")

    with pytest.raises(RuntimeError):
        store.write("d/part", chunks())
    assert os.listdir(tmp_path / "d") == []


def test_local_write_keeps_old_file_until_new_is_whole(tmp_path):
    store = LocalStorage(str(tmp_path))
    store.write("f", [b"old"])

    def chunks():
        yield b"new-partial"
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.write("f", chunks())
    assert store.read("f") == b"old"


def test_fsync_skipped_only_on_memory_file_systems(tmp_path):
    assert needs_fsync(str(tmp_path)) == (_fstype(os.path.realpath(tmp_path)) not in ("tmpfs", "ramfs"))
    if os.path.isdir("/dev/shm"):
        assert needs_fsync("/dev/shm/anything") is False


def _fstype(path):
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        lines = f.readlines()
    for line in lines:
        _, mnt, fs = line.split()[:3]
        if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, fs
    return kind


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_codec_roundtrip_and_damage(codec):
    data = bytes(range(256)) * 1000
    raw = split(memoryview(data), chunk_bytes=64 << 10)
    assert len(raw) == 4
    hashes = [checksum(c) for c in raw]
    enc = Encoder(codec)
    stored = [bytes(enc.encode(c)) for c in raw]
    info = ItemInfo(0, "bytes", tuple((len(c), h) for c, h in zip(raw, hashes, strict=True)))
    rec = make_record("part", 0, stored, enc.codec, info)
    blob = bytearray(b"".join(stored))
    if codec == "zstd":
        assert len(blob) < len(data) / 10
    out = bytearray(len(data))
    decode_into(rec, memoryview(blob), memoryview(out))
    assert out == data
    verify_stored(rec, memoryview(blob))  # as a replica arriving from a peer is checked
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        decode_into(rec, memoryview(blob), memoryview(out))
    with pytest.raises(ChecksumMismatch):
        verify_stored(rec, memoryview(blob))
    with pytest.raises(ChecksumMismatch):
        verify_stored(rec, memoryview(blob)[:-1])


@pytest.mark.parametrize("outcome", ["commit", "discard"])
def test_reserve_lands_whole_or_not_at_all(store, outcome):
    res = store.reserve("d/obj", 1000)
    res.view[:] = bytes(range(250)) * 4
    assert store.size("d/obj") is None  # nothing under the name while it is being filled
    getattr(res, outcome)()
    if outcome == "commit":
        assert store.read("d/obj") == bytes(range(250)) * 4
    else:
        assert store.size("d/obj") is None
    assert store.list("d") in ([], ["obj"])  # no dirty leftovers


def test_a_committed_reservation_discarded_later_closes_nothing_again(tmp_path):
    """A discard after its commit (a later replica of the same swap failed) closes none of
    the committed file's descriptors again: their numbers may be another file's by then."""
    store = LocalStorage(str(tmp_path))  # a disk: the store's own mapped reservation
    res = store.reserve("d/obj", 100)
    res.view[:] = bytes(100)
    res.commit()
    r, w = os.pipe()  # the lowest free numbers: the committed file's directory's among them
    try:
        before = fd_table()
        res.discard()
        assert fd_table() == before
    finally:
        os.close(r)
        os.close(w)
    assert store.read("d/obj") == bytes(100)


@pytest.mark.parametrize("how", ["write", "reserve"])
def test_a_rename_that_fails_leaves_no_descriptor_open(tmp_path, how):
    """A directory where the file goes: the rename that publishes it fails, and neither the
    dirty file nor its directory's descriptor is left behind."""
    store = LocalStorage(str(tmp_path))
    (tmp_path / "d" / "obj").mkdir(parents=True)
    before = fd_table()
    with pytest.raises(IsADirectoryError):
        if how == "write":
            store.write("d/obj", [b"x" * 100])
        else:
            res = store.reserve("d/obj", 100)
            try:
                res.commit()
            finally:
                res.discard()
    assert fd_table() == before
    assert os.listdir(tmp_path / "d") == ["obj"]
