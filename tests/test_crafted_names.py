"""Whoever can write a tier cannot make a reader open anything outside it.

Real saves, then a step crafted as an attacker with write access to the tier would: a
record naming a file by ``..``, by an absolute path, in another namespace, through a block
id that is no block name; a part or a whole step directory replaced by a link to a copy
outside. The checksums (index, metadata, marker) are made to match the bytes planted, so
only the names can give them away. Each time the load uses the older step or another copy,
``verify`` and ``export`` see the damage, the writer process does not copy it down, and
the planted file is never opened: inotify sees every open by any process (a chmod 000 file
would not do, as tests may run as root). Retention and GC delete nothing outside the
namespace through a link left where a directory of it should be.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pickle
import shutil
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import preloaded
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import settle
from tiered_dcp.storage import format as layout
from tiered_dcp.storage.codec import checksum
from tiered_dcp.storage.format import (
    ItemInfo,
    Marker,
    Record,
    block_header,
    marker_key,
    metadata_key,
    part_key,
    read_index,
    step_dir,
    write_index,
)
from tiered_dcp.storage.local import LocalStorage

from tiered_dcp import (
    NoCheckpointError,
    Tier,
    TieredConfig,
    TieredReader,
    TieredWriter,
    export,
    load_latest,
    shutdown,
    writer_status,
)
from tiered_dcp.ops.verify import verify_step
from tiered_dcp.save.writer import writer_handle
from tiered_dcp.writer_process.run_dir import Job

NS = "run"
N = 4096  # values of "w": 16 KiB, one chunk, kept in the part file (no dedup)
EVIL = torch.full((N,), 666.0)
NAMES = {  # a record names the planted file
    "dotdot": "../outside.bin",
    "absolute": "/evil.bin",
    "other_namespace": part_key("other", 2, 0),
    "block_id": "../../outside.bin",
}
NAMED = list(NAMES)
LINKED = ["linked_part", "linked_step_dir"]  # a link in the step leads to it
CASES = NAMED + LINKED


def state(step: int) -> dict:
    return {"w": torch.full((N,), float(step * 10)), "b": torch.arange(64.0) + step}


def zeros() -> dict:
    return {"w": torch.zeros(N), "b": torch.zeros(64)}


def equal(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], want[k]) for k in want)


def raw(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


# -- seeing every open of a file, by any process ------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
IN_ACCESS, IN_OPEN = 0x1, 0x20


class Opens:
    """Counts the opens and reads of some files (inotify), whoever makes them."""

    def __init__(self, *paths: Path) -> None:
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, ctypes.get_errno()
        for p in paths:
            assert _libc.inotify_add_watch(self.fd, os.fsencode(p), IN_OPEN | IN_ACCESS) >= 0, p
        self.seen = 0

    def count(self) -> int:
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return self.seen
            pos = 0
            while pos < len(buf):
                _, _, _, n = struct.unpack_from("iIII", buf, pos)
                pos += 16 + n
                self.seen += 1

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def never_opened(*paths: Path) -> Iterator[None]:
    opens = Opens(*paths)
    try:
        yield
        assert opens.count() == 0, f"{[str(p) for p in paths]} opened {opens.count()} time(s)"
    finally:
        opens.close()


def test_the_open_detector_sees_an_open(tmp_path):
    """The check the tests rely on fails when the file is opened."""
    f = tmp_path / "f"
    f.write_bytes(b"x")
    with pytest.raises(AssertionError, match="opened"), never_opened(f):
        f.read_bytes()


# -- crafting a step ----------------------------------------------------------------------


def forge(
    root: Path, step: int, file: str | None, evil: bytes, blocks: tuple[str, ...] | None = None
) -> None:
    """Step's record of ``w`` now says its bytes are ``evil`` (in ``file``, or ``blocks``), at
    offset 0 or where they were, with the index, the metadata and the marker agreeing."""
    store = LocalStorage(str(root))
    index = read_index(store, NS, step, 0, 1 << 30)
    key = next(k for k in index.records if k.fqn == "w")
    rec = index.records[key]
    n, h = len(evil), checksum(evil)
    rec = dataclasses.replace(
        rec,
        file=rec.file if file is None else file,
        offset=rec.offset if file is None else 0,
        codec="raw",
        codecs=None,
        stored=(n,),  # a block's stored length leaves its header out
        info=dataclasses.replace(rec.info, raw_chunks=((n, h),)),
        blocks=blocks,
    )
    write_index(store, NS, step, dataclasses.replace(index, records={**index.records, key: rec}))
    md = pickle.loads(store.read(metadata_key(NS, step)))  # our own test file: plain pickle
    for idx, info in md.storage_data.items():
        if idx.fqn == "w":
            info["chunks"] = [[n, h]]
    blob = pickle.dumps(md)
    store.write(metadata_key(NS, step), [blob])
    marker = Marker.from_bytes(store.read(marker_key(NS, step)))
    marker = dataclasses.replace(marker, metadata_size=len(blob), metadata_xxh3=checksum(blob))
    store.write(marker_key(NS, step), [marker.to_bytes()])


def craft(case: str, root: Path, step: int = 2) -> Path:
    """Make ``step`` in ``root`` load EVIL through ``case``; return the planted file."""
    evil = raw(EVIL)
    outside = root.parent / "outside.bin"
    if case == "dotdot":
        outside.write_bytes(evil)
        forge(root, step, NAMES[case], evil)
        return outside
    if case == "absolute":  # joined to the root, it lands outside the namespace
        planted = root / "evil.bin"
        planted.write_bytes(evil)
        forge(root, step, NAMES[case], evil)
        return planted
    if case == "other_namespace":
        planted = root / part_key("other", step, 0)
        planted.parent.mkdir(parents=True)
        planted.write_bytes(evil)
        forge(root, step, NAMES[case], evil)
        return planted
    if case == "block_id":  # its key: run/blocks/../../../outside.bin
        (root / NS / "blocks").mkdir()  # for ".." to resolve from it
        outside.write_bytes(block_header("raw") + evil)
        forge(root, step, f"{NS}/blocks", evil, blocks=(NAMES[case],))
        return outside
    part = root / part_key(NS, step, 0)
    data = evil_part(root, step)
    if case == "linked_part":
        outside.write_bytes(data)
        part.unlink()
        part.symlink_to(outside)
        return outside
    assert case == "linked_step_dir"
    part.write_bytes(data)
    moved = root.parent / "outside_step"
    (root / step_dir(NS, step)).rename(moved)
    (root / step_dir(NS, step)).symlink_to(moved, target_is_directory=True)
    return moved / part.name


def evil_part(root: Path, step: int) -> bytes:
    """Step's part with the bytes of ``w`` replaced by EVIL's, its checksums made to match
    them (the part file itself is left as it is)."""
    records = read_index(LocalStorage(str(root)), NS, step, 0, 1 << 30).records
    at = next(r for k, r in records.items() if k.fqn == "w").offset
    forge(root, step, None, raw(EVIL))  # the record stays; the bytes it points at change
    data = bytearray((root / part_key(NS, step, 0)).read_bytes())
    data[at : at + len(raw(EVIL))] = raw(EVIL)
    return bytes(data)


def one_tier(tmp_path: Path, shared: bool = False) -> TieredConfig:
    return TieredConfig(NS, [Tier(str(tmp_path / "ram"), keep=5, shared=shared)])


def save(cfg: TieredConfig, *steps: int) -> None:
    for s in steps:
        dcp.save(state(s), storage_writer=TieredWriter(cfg, step=s))


# -- the read side --------------------------------------------------------------------------


def test_the_rule_admits_only_the_layouts_own_names():
    rec = lambda file, blocks=None: Record(file, 0, "raw", (1,), ItemInfo(0, "bytes", ((1, 0),)), blocks)  # noqa: E731
    good = [rec(part_key(NS, 2, 0)), rec(part_key(NS, 1, 7)), rec(f"{NS}/blocks", ("0" * 32, "ab" * 16))]
    assert [layout.stray_name(r, NS) for r in good] == [None, None, None]
    files = [
        "../outside.bin",
        "/evil.bin",
        "/" + part_key(NS, 2, 0),
        f"{NS}/step_000000000002/../step_000000000001/rank_00000.part",
        f"{NS}\\step_000000000002\\rank_00000.part",
        part_key(NS, 2, 0) + "\0",
        f"{NS}/step_2/rank_00000.part",  # the layout's names have 12 digits
        f"{NS}/step_000000000002/rank_\u0661.part",  # and ASCII ones
        part_key("other", 2, 0),
        f"{NS}/step_000000000002/metadata",
    ]
    assert [layout.stray_name(rec(f), NS) for f in files] == files
    blocks = ["../../outside.bin", "ABCDEF" * 5 + "AB", "0" * 31]  # ids: 32 lower-case hex digits
    assert [layout.stray_name(rec(f"{NS}/blocks", ("0" * 32, b)), NS) for b in blocks] == blocks
    assert layout.stray_name(rec("other/blocks", ("0" * 32,)), NS) == "other/blocks"


@pytest.mark.parametrize("field", ["namespace", "node"])
def test_a_marker_naming_another_namespace_or_node_path_is_ignored(tmp_path, field):
    """A marker's namespace becomes part of the metadata's key, a part's node part of a
    root's path: one that leads elsewhere makes the step not committed there."""
    cfg = TieredConfig(NS, [Tier(str(tmp_path / "ram" / "{node}"), keep=5)])
    save(cfg, 1, 2)
    root = tmp_path / "ram" / "0"
    marker = Marker.from_bytes((root / marker_key(NS, 2)).read_bytes())
    if field == "namespace":  # its metadata key: <root>/../elsewhere/step_.../metadata
        planted = tmp_path / "ram" / metadata_key("elsewhere", 2)
        planted.parent.mkdir(parents=True)
        shutil.copy(root / metadata_key(NS, 2), planted)
        marker = dataclasses.replace(marker, namespace="../elsewhere")
    else:  # the root of node "../evil": tmp_path/evil, a copy of this one with step 2 crafted
        evil = tmp_path / "evil"
        shutil.copytree(root, evil)
        (evil / part_key(NS, 2, 0)).write_bytes(evil_part(evil, 2))
        shutil.copy(evil / metadata_key(NS, 2), root / metadata_key(NS, 2))
        marker = Marker.from_bytes((evil / marker_key(NS, 2)).read_bytes())
        marker.parts[0].node = "../evil"
        planted = evil / part_key(NS, 2, 0)
    (root / marker_key(NS, 2)).write_bytes(marker.to_bytes())
    got = zeros()
    with never_opened(planted):
        reader = TieredReader(cfg)
        assert reader.step == 1
        dcp.load(got, storage_reader=reader)
    assert equal(got, state(1))


@pytest.mark.parametrize("shared", [False, True], ids=["node_local", "shared"])
@pytest.mark.parametrize("case", CASES)
def test_a_crafted_step_loads_the_older_step_and_opens_nothing_outside(tmp_path, case, shared, caplog):
    cfg = one_tier(tmp_path, shared)
    save(cfg, 1, 2)
    planted = craft(case, tmp_path / "ram")
    got = zeros()
    with never_opened(planted):
        assert load_latest(got, cfg) == 1
    assert equal(got, state(1))
    if case in NAMED:  # the warning names the record's name
        assert any("names " in r.getMessage() and "not read" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_copy_is_passed_over_for_another_tiers_copy(tmp_path, case):
    cfg = TieredConfig(NS, [Tier(str(tmp_path / "ram"), keep=5), Tier(str(tmp_path / "ssd"), keep=5)])
    save(cfg, 1, 2)
    settle(cfg)
    shutdown()
    planted = craft(case, tmp_path / "ram")
    got = zeros()
    with never_opened(planted):
        reader = TieredReader(cfg)
        assert reader.step == 2 and reader.tiers == [1]
        dcp.load(got, storage_reader=reader)
    assert equal(got, state(2))


@pytest.mark.parametrize("case", CASES)
def test_verify_reports_a_crafted_step_damaged_and_opens_nothing_outside(tmp_path, case):
    cfg = one_tier(tmp_path)
    save(cfg, 1, 2)
    planted = craft(case, tmp_path / "ram")
    with never_opened(planted):
        checks = verify_step(cfg, 2)
    if case == "linked_step_dir":  # its marker is behind the link: the step is not there at all
        assert checks == []
        return
    (check,) = checks
    assert not check.ok
    problems = " ".join(check.problems)
    if case in NAMED:
        assert f"names {NAMES[case]!r}" in problems and "rank_00000.index" in problems, problems
    else:
        assert part_key(NS, 2, 0) in problems and "missing" in problems, problems


def test_the_verify_command_says_damaged_and_names_the_record(tmp_path):
    cfg = one_tier(tmp_path)
    save(cfg, 1, 2)
    planted = craft("dotdot", tmp_path / "ram")
    with never_opened(planted):
        r = preloaded.run(
            [
                sys.executable,
                "-m",
                "tiered_dcp.cli",
                "verify",
                "-n",
                NS,
                str(tmp_path / "ram"),
                "--step",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED" in r.stdout and "'../outside.bin'" in r.stdout, r.stdout


@pytest.mark.parametrize("case", CASES)
def test_export_takes_the_older_step_and_refuses_the_crafted_one(tmp_path, case):
    cfg = one_tier(tmp_path)
    save(cfg, 1, 2)
    planted = craft(case, tmp_path / "ram")
    with never_opened(planted):
        dest = export(cfg, None, tmp_path / "exported")
        with pytest.raises(NoCheckpointError, match="step 2"):
            export(cfg, 2, tmp_path / "exported2")
    got = zeros()
    dcp.load(got, storage_reader=dcp.FileSystemReader(dest))
    assert equal(got, state(1))


@pytest.mark.parametrize("case", CASES)
def test_the_writer_process_does_not_copy_a_crafted_step_down(tmp_path, case):
    """The step is saved to the RAM tier alone, crafted there, then handed to the writer of
    a job with a slower tier, as a save would have handed it."""
    cfg = TieredConfig(NS, [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])
    save(one_tier(tmp_path), 1, 2)
    planted = craft(case, tmp_path / "ram")
    handle = writer_handle(cfg, 0)
    with never_opened(planted):
        handle.enqueue(Job(2, 0, 1, 0, 0, time.time()))
        handle.ensure(os.getpid())
        settle(cfg, timeout=120)
    (w,) = writer_status(cfg)
    assert [(s, t) for s, t, _ in w.failed] == [(2, 1)], w
    if case in NAMED:
        assert "names " in w.failed[0][2], w.failed
    assert not (tmp_path / "ssd" / marker_key(NS, 2)).exists()
    for f in (tmp_path / "ssd").rglob("*"):
        assert not f.is_file() or raw(EVIL) not in f.read_bytes(), f
    shutdown()


# -- retention and GC -------------------------------------------------------------------------


def test_block_gc_deletes_nothing_through_a_linked_block_directory(tmp_path):
    cfg = TieredConfig(NS, [Tier(str(tmp_path / "ram"), keep=1)], dedup=True)
    big = lambda s: {"w": torch.full((1 << 18,), float(s))}  # noqa: E731 - 1 MiB: one block
    dcp.save(big(1), storage_writer=TieredWriter(cfg, step=1))
    blocks = tmp_path / "ram" / NS / "blocks"
    held = {p.name for p in blocks.glob("??/*")}
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / ("ab" + "0" * 30)  # named as a block: a GC would delete it if it saw it
    precious.write_bytes(b"precious")
    (blocks / "ab").symlink_to(outside, target_is_directory=True)
    dcp.save(big(2), storage_writer=TieredWriter(cfg, step=2))  # retention drops step 1, then GC
    assert precious.read_bytes() == b"precious"
    assert not held & {p.name for p in blocks.glob("??/*")}  # the GC did run: step 1's block went
    shutdown()


def test_retention_deletes_nothing_through_a_linked_spare_directory(shm):
    cfg = TieredConfig(NS, [Tier(str(shm / "ram"), keep=1)])
    outside = shm / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious")
    (shm / "ram" / NS).mkdir(parents=True)
    (shm / "ram" / NS / "spare").symlink_to(outside, target_is_directory=True)
    save(cfg, 1, 2, 3)  # two retentions: each drops a step, the second clears the spares
    assert sorted(os.listdir(outside)) == ["precious"]
    assert (outside / "precious").read_bytes() == b"precious"
    got = zeros()
    dcp.load(got, storage_reader=TieredReader(cfg))
    assert equal(got, state(3))
    shutdown()


def test_retention_deletes_nothing_through_a_linked_step_directory(shm):
    cfg = TieredConfig(NS, [Tier(str(shm / "ram"), keep=1)])
    save(cfg, 1, 2)
    planted = craft("linked_step_dir", shm / "ram", step=2)
    before = planted.read_bytes()
    save(cfg, 3, 4)  # step 2 goes at the first retention, the spares it would leave at the second
    assert planted.read_bytes() == before
    assert not os.path.lexists(shm / "ram" / step_dir(NS, 2))  # the link went, not what it points at
    shutdown()


# -- writes -----------------------------------------------------------------------------------


def test_a_write_follows_no_link_in_the_tier(tmp_path):
    """A link where a directory of the tier should be fails the write (nothing written where
    it points); a link at the file's own name is replaced by the file, its target untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"precious")
    store = LocalStorage(str(tmp_path / "tier"))
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / NS).symlink_to(outside, target_is_directory=True)
    for write in (
        lambda: store.write(f"{NS}/step_000000000001/rank_00000.part", [b"x" * 10]),
        lambda: store.reserve(f"{NS}/step_000000000001/rank_00000.part", 10),
    ):
        with pytest.raises(FileNotFoundError, match="a link, or a file"):
            write()
    assert sorted(os.listdir(outside)) == ["precious"]
    (tmp_path / "tier" / NS).unlink()
    (tmp_path / "tier" / NS).mkdir()
    (tmp_path / "tier" / NS / "k").symlink_to(outside / "precious")
    store.write(f"{NS}/k", [b"new"])
    assert (outside / "precious").read_bytes() == b"precious"
    assert (
        not (tmp_path / "tier" / NS / "k").is_symlink()
        and (tmp_path / "tier" / NS / "k").read_bytes() == b"new"
    )


def test_the_writer_process_writes_nothing_through_a_link_in_a_slower_tier(tmp_path):
    """Whoever can write the SSD tier links the namespace's directory there to a directory
    of the job's user: the copy down fails (reported), and nothing lands where it points."""
    outside = tmp_path / "home"
    outside.mkdir()
    (tmp_path / "ssd").mkdir()
    (tmp_path / "ssd" / NS).symlink_to(outside, target_is_directory=True)
    cfg = TieredConfig(NS, [Tier(str(tmp_path / "ram")), Tier(str(tmp_path / "ssd"))])
    save(cfg, 2)
    settle(cfg, timeout=120)
    (w,) = writer_status(cfg)
    assert [(s, t) for s, t, _ in w.failed] == [(2, 1)], w
    assert os.listdir(outside) == []
    shutdown()


def test_staging_into_the_ram_tier_writes_nothing_through_a_linked_step_directory(shm):
    """The step directory a save will stage into was left as a link to a directory outside:
    the save fails (its first copy, in private memory, reaches no part file there; DCP
    raises it from the future), and nothing lands where the link points."""
    cfg = TieredConfig(NS, [Tier(str(shm / "ram"), keep=2)])
    save(cfg, 1)
    outside = shm / "outside"
    outside.mkdir()
    (shm / "ram" / step_dir(NS, 2)).symlink_to(outside, target_is_directory=True)
    with pytest.raises(BaseException, match="a link, or a file"):
        dcp.async_save(state(2), storage_writer=TieredWriter(cfg, step=2)).result()
    assert os.listdir(outside) == []
    shutdown()
