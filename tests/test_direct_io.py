"""The disk tier at the disk's pace: part files written and cold ranges read with O_DIRECT,
on the machine's own disk (tests need ``tmp_path`` on a disk, not in memory).

Real page-cache counts (``mincore`` on the test's own files), a real writer process
killed in the middle of a direct copy, and a real ext4 file system filled up (a loop mount;
skipped without root)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import settle
from tiered_dcp.storage import PermanentStorageError
from tiered_dcp.storage.direct_io import _REFUSED, ALIGN, BUFFER_BYTES, resident_pages, set_direct
from tiered_dcp.storage.format import marker_key, part_key
from tiered_dcp.storage.local import DIRTY, LocalStorage, in_memory
from tiered_dcp.storage.records import REFS_LIMIT, read_record

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, wait_for, writer_status
from tiered_dcp.load.device_reads import HostCopier, Ring
from tiered_dcp.steps.catalog import TierView
from tiered_dcp.steps.retention import apply_retention

MiB = 1 << 20
FIXED = 1 * MiB  # what a read may allocate beyond the bytes it returns


@pytest.fixture
def disk(tmp_path) -> Path:
    if in_memory(str(tmp_path)):
        pytest.skip("the temporary directory is in memory: no disk to write directly to")
    return tmp_path


def _bytes(n: int, seed: int = 0) -> bytes:
    return (
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        .numpy()
        .tobytes()
    )


def _pieces(data: bytes, sizes: tuple[int, ...] = (MiB + 7, 3 * MiB - 1, 5 * MiB + 4093)) -> list[memoryview]:
    """``data`` cut in chunks of uneven sizes, so buffers fill across chunk boundaries."""
    out, at, i = [], 0, 0
    while at < len(data):
        out.append(memoryview(data)[at : at + sizes[i % len(sizes)]])
        at, i = at + sizes[i % len(sizes)], i + 1
    return out


def _cached(path: str | Path) -> tuple[int, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_pages(fd)
    finally:
        os.close(fd)


def _drop(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_part_written_direct_is_whole_and_leaves_only_its_tail_page_cached(disk):
    store = LocalStorage(str(disk / "ssd"))
    data = _bytes(3 * BUFFER_BYTES + 12345)
    assert store.write("s/part", _pieces(data)) == len(data)
    cached, pages = _cached(store.path("s/part"))
    assert pages == -(-len(data) // ALIGN) and cached <= 1, (cached, pages)  # the buffered tail alone
    assert store.read("s/part") == data
    assert [n for n in store.list("s") if DIRTY in n] == []
    small = _bytes(5000, seed=1)  # smaller than one buffer (an index, a marker): the ordinary way
    assert store.write("s/index", [small]) == len(small) and store.read("s/index") == small


def test_a_cold_range_is_read_direct_and_a_cached_one_from_the_cache(disk):
    store = LocalStorage(str(disk / "ssd"))
    data = _bytes(2 * BUFFER_BYTES + 999)
    store.write("s/part", [data])
    path = store.path("s/part")
    _drop(path)
    out = bytearray(len(data) - 5000)
    store.read_into("s/part", 4099, memoryview(out))  # unaligned at both ends
    assert out == data[4099 : 4099 + len(out)]
    assert _cached(path)[0] <= 2, "a cold read went through the page cache"
    assert store.read("s/part", 3 * ALIGN + 1, 2 * MiB) == data[3 * ALIGN + 1 : 3 * ALIGN + 1 + 2 * MiB]
    assert _cached(path)[0] <= 2

    with open(path, "rb") as f:  # now in the cache: read from there, and it stays there
        f.read()
    whole = _cached(path)
    assert whole[0] == whole[1]
    out[:] = bytes(len(out))
    store.read_into("s/part", 4099, memoryview(out))
    assert out == data[4099 : 4099 + len(out)] and _cached(path) == whole

    _drop(path)
    with pytest.raises(OSError) as e:  # past the end of the file, cold: damaged, said so
        store.read_into("s/part", len(data) - MiB, memoryview(bytearray(2 * MiB)))
    assert e.value.errno == errno.EIO and "ends" in str(e.value)


def _in_progress(part: Path) -> list[tuple[int, int, int]]:
    """For each file the part is being written to (its dirty name): (its pages in the page
    cache, its pages, its size once they were counted)."""
    out = []
    for path in part.parent.glob(f"{part.name}{DIRTY}*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # renamed or gone meanwhile
            continue
        try:
            cached, pages = resident_pages(fd)
            out.append((cached, pages, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return out


def test_the_writer_copies_a_step_to_disk_with_no_page_left_dirty(disk, shm, monkeypatch):
    """Through the page cache every page the copy has written so far is in the cache (dirty
    until the fsync); direct, none of the part's pages is while it is written, and none but
    the tail's once it is committed. Counted on the part's own file (``mincore``): what
    other processes write meanwhile does not count. The writer is held to 16 MB/s, so the
    copy is seen in progress for about 2 s whatever the machine's pace."""
    cfg = TieredConfig("dio", [Tier(str(shm / "ram"), keep=1), Tier(str(disk / "ssd"), keep=1)])
    state = {"w": torch.randn(12 * MiB), "b": torch.arange(7)}  # 48 MiB: six buffers
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "16")
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    part = Path(cfg.tiers[1].root(0, 0)) / part_key("dio", 1, 0)
    samples, deadline = [], time.monotonic() + 120
    while not part.exists():
        assert time.monotonic() < deadline, "the writer never wrote its copy"
        samples += _in_progress(part)
        time.sleep(0.01)
    wait_for(cfg, 1, timeout=120)
    size = part.stat().st_size
    during = [(c, n) for c, n, after in samples if n * ALIGN >= 2 * BUFFER_BYTES and after < size]
    assert during, f"the copy was never seen with two buffers written: {samples[-5:]}"
    cached, pages = max(during)
    assert cached < BUFFER_BYTES // ALIGN, f"{cached} of its {pages} pages cached while it was written"
    cached, pages = _cached(part)
    assert pages >= 48 * MiB // ALIGN and cached <= 1, (cached, pages)
    target = {"w": torch.zeros(12 * MiB), "b": torch.zeros(7, dtype=torch.long)}
    dcp.load(target, storage_reader=TieredReader(TieredConfig("dio", [cfg.tiers[1]]), step=1))
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    shutdown()


def test_a_writer_killed_in_a_direct_copy_commits_nothing_torn(disk, shm, monkeypatch):
    """SIGKILL once direct buffers have landed in the dirty part: no marker, no clean part on
    the disk; the next writer copies the step again, whole."""
    cfg = TieredConfig("diok", [Tier(str(shm / "ram"), keep=2), Tier(str(disk / "ssd"), keep=2)])
    state = {"w": torch.randn(10 * MiB)}  # 40 MiB: five buffers
    monkeypatch.setenv("TIERED_DCP_WRITER_MBPS", "10")
    dcp.save(state, storage_writer=TieredWriter(cfg, step=1))
    step_dir = Path(cfg.tiers[1].root(0, 0)) / part_key("diok", 1, 0)
    deadline = time.monotonic() + 60
    while not [p for p in step_dir.parent.glob(f"*{DIRTY}*") if p.stat().st_size >= BUFFER_BYTES]:
        assert time.monotonic() < deadline, "no direct buffer reached the disk"
        time.sleep(0.02)
    (w,) = writer_status(cfg)
    os.kill(w.pid, signal.SIGKILL)
    while writer_status(cfg)[0].running:
        time.sleep(0.05)
    ssd = LocalStorage(cfg.tiers[1].root(0, 0))
    assert not ssd.exists(marker_key("diok", 1)) and not step_dir.exists()
    monkeypatch.delenv("TIERED_DCP_WRITER_MBPS")
    dcp.save({"w": state["w"] + 1}, storage_writer=TieredWriter(cfg, step=2))  # a new writer resumes
    for step in (1, 2):
        wait_for(cfg, step, timeout=60)
        target = {"w": torch.zeros(10 * MiB)}
        dcp.load(target, storage_reader=TieredReader(TieredConfig("diok", [cfg.tiers[1]]), step=step))
        assert torch.equal(target["w"], state["w"] + (step - 1))
    settle(cfg)
    shutdown()


def test_a_file_system_refusing_direct_io_is_written_the_ordinary_way_said_once(disk, caplog):
    """No file system here refuses O_DIRECT (tmpfs takes it since Linux 6.6), so the refusal
    is the kernel's answer for /dev/null, taken as the root's: the same flow then writes
    through the page cache, whole, and says so once."""
    root = str(disk / "nodirect")
    store = LocalStorage(root)
    caplog.set_level(logging.WARNING, logger="tiered_dcp.storage.direct_io")
    with open(os.devnull, "wb") as null:
        assert not set_direct(null.fileno(), True, root)
        assert not set_direct(null.fileno(), True, root)
    try:
        data = _bytes(2 * BUFFER_BYTES + 3)
        store.write("s/part", _pieces(data))
        cached, pages = _cached(store.path("s/part"))
        assert cached == pages  # written through the cache
        assert store.read("s/part") == data
        _drop(store.path("s/part"))
        assert store.read("s/part", 5, 2 * MiB) == data[5 : 5 + 2 * MiB]
        said = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
        assert len(said) == 1 and root in said[0].getMessage()
    finally:
        _REFUSED.discard(root)


@pytest.fixture
def small_ext4(tmp_path):
    """A real 16 MiB ext4 file system (a loop mount: needs root)."""
    image, mnt = tmp_path / "small.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 * MiB)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    if (
        made.returncode
        or subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True).returncode
    ):
        pytest.skip("mounting a loop ext4 needs root and mkfs.ext4")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def test_a_full_disk_fails_a_direct_write_cleanly(small_ext4):
    store = LocalStorage(str(small_ext4 / "root"))
    with pytest.raises(PermanentStorageError) as e:
        store.write("s/part", _pieces(_bytes(24 * MiB)))
    assert e.value.errno == errno.ENOSPC and store.describe("s/part") in str(e.value)
    assert store.list("s") == []  # no dirty leftover holding the space
    data = _bytes(9 * MiB + 5, seed=2)
    assert store.write("s/part", [data]) == len(data) and store.read("s/part") == data


class AddressCopier(HostCopier):
    """The ring's host copy, keeping the address each copy started from."""

    def __init__(self) -> None:
        self.sources: list[int] = []

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.sources.append(src.data_ptr())
        dst.copy_(src)


def test_a_cold_chunk_for_a_device_is_read_by_the_disk_into_the_ring_slot(disk):
    """Onto a device, a cold disk tier's chunk lands in the pinned slot by the direct read
    itself (its aligned span placed in the slot, the copy to the device starting inside it),
    no bounce buffer: here an item at an odd offset, whose bytes then sit at odd addresses of
    the slot (a bounce copy would put each chunk at the slot's start)."""
    cfg = TieredConfig("ring", [Tier(str(disk / "ssd"))])
    g = torch.Generator().manual_seed(3)
    want = {
        "a": torch.randint(0, 256, (3 * MiB + 7,), dtype=torch.uint8, generator=g),
        "b": torch.randint(0, 256, (20 * MiB + 13,), dtype=torch.uint8, generator=g),
    }
    dcp.save(want, storage_writer=TieredWriter(cfg, step=1))
    ring = Ring(AddressCopier(), slots=3)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    reader = TieredReader(cfg, 1)
    reader._reads.ring_for = lambda device: ring
    dcp.load(got, storage_reader=reader)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert any(p % 2 for p in ring.copier.sources), "every chunk went through a bounce buffer"
    part = Path(cfg.tiers[0].root(0, 0)) / part_key("ring", 1, 0)
    assert _cached(part)[0] <= 2, "the load pulled the step through the page cache"
    shutdown()


@contextlib.contextmanager
def _peak_allocated() -> Iterator[list[int]]:
    """The most bytes Python allocated inside the block beyond what it held at its start
    (``tracemalloc``: every bytes and bytearray a read makes is counted)."""
    out = [0]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield out
        out[0] = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def test_a_small_record_read_with_a_large_limit_allocates_its_size(disk):
    """A record is read bounded by its kind's limit (64 MiB for a blocks list): what is
    allocated is the file's size, not the limit."""
    store = LocalStorage(str(disk / "ssd"))
    store.write("s/refs", [b"x" * 3000])
    with _peak_allocated() as peak:
        assert read_record(store, "s/refs", REFS_LIMIT) == b"x" * 3000
    assert peak[0] < 3000 + FIXED, peak[0]
    assert store.read("s/refs", 1000, 10 * MiB) == b"x" * 2000 and store.read("s/refs", 5000, MiB) == b""


def test_a_retention_pass_over_four_kept_steps_allocates_their_records_sizes(disk):
    """Retention reads each kept step's marker, index and blocks list: on a disk tier it
    allocates about their sizes, not each one's limit."""
    root = disk / "ssd"
    state = {"w": torch.arange(float(MiB)), "b": torch.ones(64)}
    for step in range(1, 6):
        state["w"][step] = -1.0  # one block changes a step
        keep_all = TieredConfig("run", [Tier(str(root))], dedup=True)
        dcp.save(state, storage_writer=TieredWriter(keep_all, step=step))
    cfg = TieredConfig("run", [Tier(str(root), keep=4)], dedup=True)
    records = sum(p.stat().st_size for p in root.glob("run/step_*/*") if not p.name.endswith(".part"))
    with _peak_allocated() as peak:
        apply_retention(TierView(cfg, 0, 0, 0), 5)
    assert sorted(p.name for p in root.glob("run/step_*")) == [f"step_00000000000{s}" for s in (2, 3, 4, 5)]
    assert peak[0] < records + FIXED, (peak[0], records)
