"""Serving a peer's items after a node loss: read straight into the buffer that is sent,
each item sent as soon as it is read (real files, real gloo groups)."""

from __future__ import annotations

import os
import re
import shutil
import time
import tracemalloc

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_ranks
from said import kept_warnings
from tiered_dcp.planners.load import _spot
from tiered_dcp.storage import open_storage
from tiered_dcp.storage.codec import ChecksumMismatch
from tiered_dcp.storage.format import IndexCache, part_key
from torch.distributed.checkpoint.metadata import MetadataIndex

from tiered_dcp import Tier, TieredConfig, TieredReader, TieredWriter, wait_for
from tiered_dcp.load import peer_exchange
from tiered_dcp.load.step_reads import StepReads


def _saved(root: str, compression: str | None = None) -> tuple[dict, object, dict]:
    """A step saved by one process: its state, its root and rank 0's index records."""
    state = {f"w{i}": torch.arange(1000 * (i + 1), dtype=torch.float32) for i in range(3)}
    config = TieredConfig("serve", [Tier(f"{root}/ram", every=1, keep=1, compression=compression)])
    dcp.save(state, storage_writer=TieredWriter(config, step=1), no_dist=True)
    store = open_storage(f"{root}/ram")
    index = IndexCache().get(store, "serve", 1, 0, 1 << 30)
    assert index is not None
    return state, store, {k.fqn: r for k, r in index.records.items()}


def _served(store, rec) -> torch.Tensor:
    """An item as a peer receives it: chunk by chunk, each read into one reused buffer."""
    chunks = [n for n, _ in rec.info.raw_chunks]
    read = peer_exchange.chunk_reader(store, rec, chunks)
    slot, got = torch.empty(max(chunks, default=0), dtype=torch.uint8), []
    for j, n in enumerate(chunks):
        read(j, slot[:n])
        got.append(slot[:n].clone())
    return torch.cat(got) if got else torch.empty(0, dtype=torch.uint8)


def test_an_item_is_served_chunk_by_chunk_into_a_reused_buffer(tmp_path):
    state, store, records = _saved(str(tmp_path))
    big = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: three chunks
    config = TieredConfig("serve", [Tier(f"{tmp_path}/ram", every=1, keep=2)])
    dcp.save({"big": big}, storage_writer=TieredWriter(config, step=2), no_dist=True)
    index = IndexCache().get(store, "serve", 2, 0, 1 << 30)
    assert index is not None
    rec = next(r for k, r in index.records.items() if k.fqn == "big")
    assert len(rec.info.raw_chunks) == 3
    read = peer_exchange.chunk_reader(store, rec, [n for n, _ in rec.info.raw_chunks])
    slot = torch.empty(8 << 20, dtype=torch.uint8)
    tracemalloc.start()  # Python-level buffers (a bytearray scratch) are traced; the slot is not
    try:
        read(1, slot[: rec.info.raw_chunks[1][0]])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), f"{peak} bytes of scratch for an 8 MiB raw chunk"  # read in place
    assert torch.equal(_served(store, rec).view(torch.float32), big)
    for fqn, rec in records.items():
        assert torch.equal(_served(store, rec).view(torch.float32), state[fqn])
    with pytest.raises(KeyError, match="chunks here are"):  # asked by another layout: not served
        peer_exchange.chunk_reader(store, rec, [rec.info.raw_length // 2] * 2)


def test_a_damaged_raw_item_is_not_served(tmp_path):
    _, store, records = _saved(str(tmp_path))
    rec = records["w1"]
    path = store.path(rec.file)
    with open(path, "r+b") as f:
        f.seek(rec.offset + 8)
        byte = f.read(1)
        f.seek(rec.offset + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatch):
        _served(store, rec)
    assert torch.equal(_served(store, records["w0"]).view(torch.float32), torch.arange(1000.0))


def test_a_compressed_item_is_served_decoded(tmp_path):
    state, store, records = _saved(str(tmp_path), compression="zstd")
    assert any(r.codec != "raw" or r.codecs is not None for r in records.values())
    for fqn, rec in records.items():
        assert torch.equal(_served(store, rec).view(torch.float32), state[fqn])
    assert os.path.getsize(store.path(part_key("serve", 1, 0))) > 0


def _through_a_send_ring(rank: int, world: int) -> tuple[int, list[list[float]]]:
    from tiered_dcp.ranks.transport import Group

    group = Group("test/send-ring", [0, 1], rank, timeout=20)
    try:
        if rank == 0:  # ten buffers through two slots: each taken again once its send ran
            ring = peer_exchange.SendRing(slots=2, slot_bytes=64)
            for i in range(10):
                slot = ring.take(64)
                slot.view(torch.float32)[:] = float(i)
                ring.sent(slot, [(group, group.post([(1, slot)], []))])
            ring.finish()
            return ring.made, []
        got = [torch.empty(16) for _ in range(10)]
        group.wait(group.post([], [(0, t) for t in got]))
        return 0, [t.tolist() for t in got]
    finally:
        group.close()


def test_a_send_ring_reuses_its_slots_once_their_sends_ran():
    """What a rank serving a lost node's parts holds: the ring's slots, not the parts."""
    (made, _), (_, got) = run_ranks(_through_a_send_ring, 2)
    assert made == 2
    assert got == [[float(i)] * 16 for i in range(10)]


def _posted_one_by_one(rank: int, world: int) -> list[list[float]]:
    from tiered_dcp.ranks.transport import Group

    group = Group("test/posted-one-by-one", [0, 1], rank, timeout=20)
    try:
        if rank == 0:  # each buffer posted on its own, as a server posts each item once read
            sends = [torch.full((n,), float(n)) for n in (3, 5, 7)]
            works = [w for t in sends for w in group.post([(1, t)], [])]
            group.wait(works)
            return []
        got = [torch.empty(n) for n in (3, 5, 7)]  # posted together, in the same order
        group.wait(group.post([], [(0, t) for t in got]))
        return [t.tolist() for t in got]
    finally:
        group.close()


def test_buffers_posted_in_several_calls_meet_their_receives_in_order():
    results = run_ranks(_posted_one_by_one, 2, timeout=120)
    assert results[1] == [[3.0] * 3, [5.0] * 5, [7.0] * 7]


ITEMS = 4  # items of its own per rank


def _streaming_config(root: str) -> TieredConfig:
    return TieredConfig(
        "stream",
        [Tier(f"{root}/ram/{{node}}", every=1, keep=1), Tier(f"{root}/bucket", every=1, shared=True)],
        replication_factor=2,
        replication_jump=2,
        peer_timeout=3.0,
    )


def _names(rank: int) -> list[str]:
    """Names for a rank's items that the load plan sends to one holder each: after node 1
    is lost, rank 0 serves all of rank 2's and rank 1 all of rank 3's (the plan rotates an
    item's holders, ranks 0 and 1, by the item)."""
    names, i = [], 0
    while len(names) < ITEMS:
        name = f"r{rank}.{i}"
        if _spot(MetadataIndex(name, [0])) % 2 == rank % 2:
            names.append(name)
        i += 1
    return names


def _own_state(rank: int) -> dict:
    return {name: torch.full((1000,), float(100 * rank + i)) for i, name in enumerate(_names(rank))}


def _save_for_streaming(rank: int, world: int, root: str) -> None:
    config = _streaming_config(root)
    dcp.save(_own_state(rank), storage_writer=TieredWriter(config, step=1))
    wait_for(config, 1, timeout=60)


def _load_with_a_stalling_server(rank: int, world: int, root: str) -> tuple[int, list[str]]:
    """Ranks 0 and 1 (node 0) serve node 1's ranks their first item, then stall for twice
    the peer timeout before serving the next."""
    lines = kept_warnings()

    class StallingReads(StepReads):
        served = 0

        def _serve(self, req):
            self.served += 1
            if self.served == 2:
                time.sleep(6.0)
            return super()._serve(req)

    class StallingReader(TieredReader):
        def _new_reads(self, opened):  # at the step's opening, on every rank
            return StallingReads(opened)

    config = _streaming_config(root)
    target = {k: torch.zeros_like(v) for k, v in _own_state(rank).items()}
    reader = StallingReader(config) if rank < 2 else TieredReader(config)
    dcp.load(target, storage_reader=reader)
    for k, v in _own_state(rank).items():
        assert torch.equal(target[k], v), k
    return reader.step, lines


def test_items_that_arrived_before_a_peer_stalled_are_not_read_again(tmp_path):
    """Each item a peer sent is checked and placed as it arrives: when the peer then stops
    answering, only the items still missing are read from the shared tier (all of them were,
    when a rank waited for every item of the round before placing any)."""
    run_ranks(_save_for_streaming, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": 2})
    shutil.rmtree(tmp_path / "ram" / "1")  # node 1 lost: ranks 2 and 3 ask node 0's ranks
    results = run_ranks(_load_with_a_stalling_server, 4, str(tmp_path), env={"LOCAL_WORLD_SIZE": 2})
    assert [step for step, _ in results] == [1] * 4
    for rank in (2, 3):
        fell_back = [line for line in results[rank][1] if "still missing from a shared tier" in line]
        assert len(fell_back) == 1, results[rank][1]
        missing = int(re.search(r"reading the (\d+) item\(s\)", fell_back[0]).group(1))
        assert 0 < missing < ITEMS, fell_back[0]


def _ask_twice(rank: int, world: int) -> list[list[int]]:
    """Rank 1 asks rank 0 for one item twice (two targets of it) and for another once; each
    item two chunks, served chunk by chunk (chunk j of item i filled with 10 * i + j + 1)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from tiered_dcp.ranks import worlds

    def req(i: int) -> peer_exchange.PeerRequest:
        return peer_exchange.PeerRequest(0, 0, MetadataIndex(f"item{i}"), 7, (4, 3))

    def serve(r: peer_exchange.PeerRequest):
        i = int(r.index.fqn[4:])
        return lambda j, out: out.fill_(10 * i + j + 1) is not None

    wanted = {0: [req(2), req(1), req(2)]} if rank == 1 else {}
    exchange = peer_exchange.PeerExchange(worlds.next_name("t", "load"), rank, world, 20.0)
    arrived = exchange.round(wanted, serve)
    assert arrived is not None
    return [[r.index.fqn[4:], *buf.tolist()] for _, r, buf in arrived]


def test_an_item_asked_for_twice_by_one_rank_arrives_whole_twice():
    """A holder sends each pair's items in one order, chunk by chunk; an item one rank asks for
    twice goes as two whole copies, in the order that rank posted its receives."""
    _, got = run_ranks(_ask_twice, 2)
    assert sorted(map(tuple, got)) == [
        ("1", 11, 11, 11, 11, 12, 12, 12),
        ("2", 21, 21, 21, 21, 22, 22, 22),
        ("2", 21, 21, 21, 21, 22, 22, 22),
    ]


def _ask_for_an_empty_item(rank: int, world: int) -> tuple[list, list]:
    """Ranks 1 and 2 ask rank 0 for an empty item; rank 1 for a 7-byte one too. What arrived
    (name, bytes), and the groups this rank opened."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from tiered_dcp.ranks import transport, worlds

    empty = peer_exchange.PeerRequest(0, 0, MetadataIndex("empty"), 0, ())
    seven = peer_exchange.PeerRequest(0, 0, MetadataIndex("seven"), 7, (7,))
    wanted = {1: {0: [empty, seven]}, 2: {0: [empty]}}.get(rank, {})
    transport.OPENED.clear()
    exchange = peer_exchange.PeerExchange(worlds.next_name("t", "load"), rank, world, 20.0)
    arrived = exchange.round(wanted, lambda r: lambda j, out: out.fill_(7) is not None)
    assert arrived is not None
    return [[r.index.fqn, *buf.tolist()] for _, r, buf in arrived], list(transport.OPENED)


def test_a_group_opens_only_where_bytes_cross():
    """Rank 2 wants only an empty item of rank 0: it gets it without a group (a group nothing
    crosses could be closed by one member while the other still connects: gloo fails that one)."""
    (_, zero), (got1, one), (got2, two) = run_ranks(_ask_for_an_empty_item, 3)
    assert got1 == [["empty"], ["seven", 7, 7, 7, 7, 7, 7, 7]] and got2 == [["empty"]]
    assert (zero, one, two) == ([[0, 1]], [[0, 1]], [])
