"""A save every step: what each save leaves behind stays flat from step to step.

Real processes (2 ranks as 2 nodes on gloo), a real tmpfs RAM tier with ``keep=2`` and each
part replicated to the other node: a replica is received into a spare's pages (the part
file of a step retention dropped), not into a file claimed and zeroed anew each save; every
step loads back exact. Saves that come faster than their commits wait for a staging slot,
and their records say how long.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from tiered_dcp.storage.blocks import hashing
from tiered_dcp.storage.codec import ChecksumMismatch, checksum
from tiered_dcp.storage.format import ItemInfo, Record, part_key
from tiered_dcp.storage.local import LocalStorage
from tiered_dcp.storage.records import MAX_PART_BYTES, MAX_PART_CHUNKS, STORED_CHUNK_BYTES
from torch.distributed.checkpoint.metadata import MetadataIndex

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, shutdown, status
from tiered_dcp.errors import TieredCheckpointError
from tiered_dcp.save.replicate import Landing, _announced, _describes, _verify
from tiered_dcp.save.staging import POOL
from tiered_dcp.steps.metadata import records_from_json, records_to_json
from tiered_dcp.writer_process.timings import Kind, read_records

SAVES = 7
NODES = {"LOCAL_WORLD_SIZE": 1}  # each rank its own node: each part's replica crosses to the other


def _config(root: str) -> TieredConfig:
    return TieredConfig("every", [Tier(f"{root}/{{node}}", keep=2)], replication_factor=2, replication_jump=1)


def _state(rank: int, step: int) -> dict:
    return {"model": {f"r{rank}.w{i}": torch.full((256 << 10,), step + rank / 2 + i / 8) for i in range(4)}}


def _save_every_step(rank: int, world: int, root: str) -> dict:
    cfg = _config(root)
    group = dist.new_group(backend="gloo")
    inodes = []
    for step in range(1, SAVES + 1):
        writer = TieredWriter(cfg, step=step)
        dcp.async_save(_state(rank, step), storage_writer=writer, process_group=group).result()
        inodes.append(os.stat(os.path.join(root, str(rank), part_key(cfg.namespace, step, 1 - rank))).st_ino)
    exact = []
    for step in (SAVES - 1, SAVES):
        target = {"model": {k: torch.zeros_like(v) for k, v in _state(rank, 0)["model"].items()}}
        dcp.load(target, storage_reader=TieredReader(cfg, step=step), process_group=group)
        want = _state(rank, step)["model"]
        exact.append(all(torch.equal(target["model"][k], v) for k, v in want.items()))
    shutdown(wait=True, timeout=60)
    return {"inodes": inodes, "exact": exact}


def test_a_replica_is_received_into_a_recycled_part_file(shm):
    """From the 4th save on (retention has dropped a step by then), each save receives its
    peer's part into one of the dropped steps' files: the replicas of 7 saves take at most
    keep + 1 = 3 files, where a fresh file each save would take 7."""
    results = run_ranks(_save_every_step, 2, str(shm), env=NODES)
    for got in results:
        assert got["exact"] == [True, True]
        assert len(set(got["inodes"])) <= 3, got["inodes"]
        assert len(set(got["inodes"][3:])) <= 3


def test_saves_faster_than_their_commits_wait_for_a_slot_and_the_records_say_so(tmp_path):
    """Async saves with one staging slot: a save whose slot is still held (by the save
    before, uploading; for step 2 by a staged copy this test holds, let go 0.2 s after that
    save began to wait) waits in its staging until it is free, so host memory holds one
    staged copy, never two; each SAVE record says how long its save waited
    (``slot_wait_s``), the first none. Step 3 follows step 2 at once. Every step is there,
    exact. How long a save waits is the test's choice, not the machine's pace."""
    gc.collect()  # no slot still held by an earlier test's staged state, left in a cycle
    cfg = TieredConfig("faster", [Tier(f"{tmp_path}/disk", keep=3)])
    state = {"model": {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(8)}}  # 32 MiB

    def save(step: int):
        for i, v in enumerate(state["model"].values()):
            v.fill_(step + i / 8)
        fut = dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step, staging_slots=1))
        assert POOL.info()["busy"] <= 1
        return fut

    save(1).result()
    deadline = time.monotonic() + 30
    while POOL.info()["busy"]:  # DCP's upload thread drops the staged copy just after the result
        assert time.monotonic() < deadline, POOL.info()
        time.sleep(0.01)
    held = [POOL.stage(state, slots=1)]  # the one slot, as a save still uploading holds it

    def let_go() -> None:  # 0.2 s after step 2's save began to wait on the pool (its only waiter)
        while not POOL._cond._waiters:  # noqa: SLF001 - CPython's Condition: the waits on it
            time.sleep(0.005)
        time.sleep(0.2)
        held.clear()

    releaser = threading.Thread(target=let_go, daemon=True)
    releaser.start()
    futures = [save(2)]
    assert not held  # it staged once the slot was let go
    futures.append(save(3))
    for fut in futures:
        fut.result()
    waits = {r.step: r.slot_wait_s for r in read_records(cfg, Kind.SAVE)}
    assert waits[1] is not None and waits[1] < 0.005, waits
    assert waits[2] >= 0.2 and waits[3] is not None, waits
    for step in (1, 2, 3):
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        dcp.load(target, storage_reader=TieredReader(cfg, step=step))
        assert all(
            torch.equal(t, torch.full_like(t, step + i / 8)) for i, t in enumerate(target["model"].values())
        )
    shutdown(wait=True, timeout=60)


def test_the_slower_tier_takes_every_nth_step_while_the_ram_tier_takes_every_one(shm, tmp_path):
    """A save every step to a RAM tier ``every=1, keep=2`` over a disk tier ``every=3``
    (``on_lagging_tier="wait"``: no step may be skipped): the writer process copies steps
    3, 6, 9 down as it would at any pace, the RAM tier holds the last two, and each loads
    back exact from the disk tier alone."""
    cfg = TieredConfig(
        "nth",
        [Tier(f"{shm}/ram", every=1, keep=2), Tier(f"{tmp_path}/disk", every=3, keep=3)],
        on_lagging_tier="wait",
    )
    state = {"model": {f"w{i}": torch.zeros(1 << 18) for i in range(4)}}
    for step in range(1, 10):
        for i, v in enumerate(state["model"].values()):
            v.fill_(step + i / 8)
        dcp.async_save(state, storage_writer=TieredWriter(cfg, step=step)).result()
    shutdown(wait=True, timeout=60)
    committed = {(r.tier_index, r.step) for r in status(cfg) if r.state == "committed"}
    assert committed == {(0, 8), (0, 9), (1, 3), (1, 6), (1, 9)}
    disk_only = TieredConfig("nth", [Tier(f"{tmp_path}/disk", every=3, keep=3)])
    for step in (3, 6, 9):
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        dcp.load(target, storage_reader=TieredReader(disk_only, step=step))
        got = target["model"].values()
        assert all(torch.equal(t, torch.full_like(t, step + i / 8)) for i, t in enumerate(got))


CHUNK = 64 << 10


def _landed(tmp_path, flipped: int | None) -> tuple[Landing, Record, Record]:
    """A replica of three 64 KiB chunks received into a real reservation, each hashed as it
    landed, as ``Swap`` does (byte ``flipped`` changed in transit, if given); the record its
    sender made of the bytes it sent, and a record of the same bytes cut into other chunks."""
    sent = b"".join(bytes([i + 1]) * CHUNK for i in range(3))
    res = LocalStorage(str(tmp_path)).reserve("job/part", len(sent))
    res.view[:] = sent
    if flipped is not None:
        res.view[flipped] ^= 0x40
    land = Landing(1, {}, res, {}, [CHUNK] * 3)
    for at in range(0, len(sent), CHUNK):
        land.arrived[(at, CHUNK)] = hashing().submit(checksum, res.view[at : at + CHUNK])

    def record(cuts: list[int]) -> Record:
        ends = [*cuts[1:], len(sent)]
        chunks = tuple((b - a, checksum(sent[a:b])) for a, b in zip(cuts, ends, strict=True))
        return Record("job/part", 0, "raw", tuple(n for n, _ in chunks), ItemInfo(1, "tensor", chunks))

    return land, record([0, CHUNK, 2 * CHUNK]), record([0, CHUNK // 2])


def test_a_replica_hashed_as_it_landed_is_checked_against_the_senders_records(tmp_path):
    land, rec, other = _landed(tmp_path, None)
    _verify(land, rec)  # each chunk's checksum taken as it landed
    _verify(land, other)  # a record that cuts the bytes otherwise: hashed again where it cuts
    land.wait_hashed()
    land.part.discard()


@pytest.mark.parametrize("flipped", [5, CHUNK + 7, 3 * CHUNK - 1])
def test_a_byte_changed_in_transit_fails_the_replica(tmp_path, flipped):
    land, rec, other = _landed(tmp_path, flipped)
    with pytest.raises(ChecksumMismatch, match=f"^chunk {flipped // CHUNK} "):
        _verify(land, rec)
    with pytest.raises(ChecksumMismatch, match=f"^chunk {0 if flipped < CHUNK // 2 else 1} "):
        _verify(land, other)
    land.wait_hashed()
    land.part.discard()


def test_records_that_do_not_describe_what_was_announced_are_refused(tmp_path):
    land, rec, _ = _landed(tmp_path, None)
    land.wait_hashed()
    land.part.discard()
    block = Record("", 0, "raw", (CHUNK,), ItemInfo(1, "tensor", ((CHUNK, 7),)), blocks=("ab" * 16,))
    land.records = {MetadataIndex("emb"): block}  # the block it named before it sent
    alias = dataclasses.replace(block, info=dataclasses.replace(block.info, shape=(2,)))
    sealed = {MetadataIndex("w"): rec, MetadataIndex("emb"): block, MetadataIndex("tied"): alias}
    assert _describes(sealed, land)  # an alias is a record of its own over a block already named
    assert not _describes({MetadataIndex("w"): rec}, dataclasses.replace(land, sizes=[CHUNK] * 2))
    other = dataclasses.replace(block, info=dataclasses.replace(block.info, raw_chunks=((CHUNK, 8),)))
    assert not _describes({MetadataIndex("w"): rec, MetadataIndex("emb"): other}, land)


def test_a_layout_that_cannot_be_read_names_the_rank_and_the_fix():
    good = json.dumps({"sizes": [CHUNK, 0], "blocks": records_to_json({}).decode()}).encode()
    assert _announced(good, 3) == ([CHUNK, 0], records_from_json(b"[]"))
    older = records_to_json({})  # what a tiered-dcp before the layout sends: its records
    for blob in (older, b'{"sizes": [-1], "blocks": "[]"}', b"not json"):
        with pytest.raises(TieredCheckpointError, match="rank 3's part layout .* same tiered-dcp version"):
            _announced(blob, 3)


TOO_MANY = [0] * (MAX_PART_CHUNKS + 1)
TOO_LARGE = [STORED_CHUNK_BYTES] * (MAX_PART_BYTES // STORED_CHUNK_BYTES + 1)


@pytest.mark.parametrize(
    "sizes, why",
    [
        ([CHUNK, True], "not True"),
        ([False], "not False"),
        ([CHUNK, -1], "not -1"),
        ([1.0], "not 1.0"),
        (["8"], "not '8'"),
        ([STORED_CHUNK_BYTES + 1], f"not {STORED_CHUNK_BYTES + 1}"),
        ({"0": 1}, "must be a list"),
        (TOO_MANY, f"at most {MAX_PART_CHUNKS} entries"),
        (TOO_LARGE, f"more than a part holds ({MAX_PART_CHUNKS} chunks, {MAX_PART_BYTES} bytes)"),
    ],
    ids=["bool", "false", "negative", "float", "text", "chunk_too_large", "object", "too_many", "too_large"],
)
def test_a_layout_out_of_a_parts_bounds_is_refused_in_one_line_naming_the_rank(sizes, why):
    """What a peer announces sizes what this rank reserves for its replica: bounded as
    what a tier holds is, before anything is reserved."""
    blob = json.dumps({"sizes": sizes, "blocks": records_to_json({}).decode()}).encode()
    with pytest.raises(TieredCheckpointError, match="^rank 3's part layout for the replica exchange") as e:
        _announced(blob, 3)
    assert why in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_layout_at_a_parts_bounds_is_read():
    largest = [STORED_CHUNK_BYTES] * (MAX_PART_BYTES // STORED_CHUNK_BYTES)
    assert _announced(json.dumps({"sizes": largest, "blocks": "[]"}).encode(), 3)[0] == largest
