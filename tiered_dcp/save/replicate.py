"""The save side of clique replication on a node-local tier.

After a rank writes its part to a node-local tier it swaps parts with its clique peers
(``cliques``) over a gloo group of their own (``transport``): each peer's part lands,
verified, in this rank's own root, with its index. With dedup a part's large tensors are
blocks (``dedup``): a peer's root claims those its part uses and receives only the ones
it lacks, into its own block store. The commit that follows, in every root once every
rank agreed its part and replicas are clean, is ``commit.AgreedCommit``'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiered_dcp.storage.base import Buffer, Reservation
from tiered_dcp.storage.blocks import pool
from tiered_dcp.storage.codec import ChecksumMismatch, verify_stored
from tiered_dcp.storage.format import BLOCK_HEADER, Chunk
from tiered_dcp.storage.format import write_index as write_part_index

from ..errors import TieredCheckpointError
from ..ranks import transport
from ..ranks.cliques import Layout
from ..ranks.transport import Group, as_bytes_tensor
from ..steps import dedup, part_file
from ..steps.catalog import TierView
from ..steps.metadata import Records, part_index, records_from_json, records_to_json
from .staging import POOL

log = logging.getLogger("tiered_dcp")


@dataclass
class SavedPart:
    """This rank's part as just written: its records and its stored chunks, in file order."""

    rank: int
    records: Records
    stored: list[Buffer]
    written_blocks: int = 0  # bytes of new blocks written for it (dedup)
    blocks: dict[str, list[Buffer]] = dataclasses.field(default_factory=dict)  # block files it wrote
    in_file: Any = None  # ``writer.InFile``: its items were staged into the part file already
    tail: list[Buffer] = dataclasses.field(default_factory=list)  # what follows them there
    pending: Callable[[], Records] | None = None  # the records, once its checksums are in

    def sealed(self) -> Records:
        """Its records: ``records`` once ``pending`` (which waits for the checksums) ran."""
        if self.pending is not None:
            self.records, self.pending = self.pending(), None
        return self.records


@dataclass
class Landing:
    """A peer's part arriving in this root: its part file, and the blocks this root lacked."""

    rank: int
    records: Records  # as the peer's root holds them
    part: Reservation
    blocks: dict[str, memoryview]  # block id -> its file's bytes (header, stored), as sent


def write_index(view: TierView, step: int, rank: int, records: Records, written: int | None = None) -> None:
    """Rank's index next to its part (or replica) in this rank's own root."""
    index = part_index(rank, records)
    if written is not None:
        index = dataclasses.replace(index, written=index.size + written)
    write_part_index(view.own, view.config.namespace, step, index)


def stored_chunk_sizes(records: Records) -> list[int]:
    """The stored length of every chunk of a part file, in file order (blocks are not in it)."""
    in_file = sorted((r for r in records.values() if r.blocks is None), key=lambda r: r.offset)
    return [n for rec in in_file for n in rec.stored]


class Swap:
    """This rank's part swapped with its clique's members on other roots, theirs landing here.

    ``start`` posts the transfers (they run in gloo's threads while the rank writes its own
    part); ``finish`` waits, verifies every replica against its checksums and renames it
    clean with its index. Any failure discards the landed replicas.

    What travels to a peer is its part file, then the block files its root lacks: the peer
    first claims every block the part uses (``dedup.claim``: its list before the GC lease,
    as a save does), then says which it lacks, so the blocks it holds are never sent.
    ``sent`` counts the bytes this rank sent.
    """

    def __init__(
        self, view: TierView, step: int, part: SavedPart, world: list[int], name: str, layout: Layout
    ) -> None:
        self.view, self.step, self.part = view, step, part
        self.members = layout.clique(part.rank)
        self.world, self.name = world, name
        self.takes = view.placement.parts_written_by(part.rank, dict(enumerate(world)), layout)[1:]
        self.landed: list[Landing] = []
        self.here: dict[str, dedup.Held | None] = {}  # the blocks the peers' parts use, in this root
        self.group: Group | None = None
        self.works: list[Any] = []
        self.sent = 0

    def start(self) -> Swap:
        view, part = self.view, self.part
        transport.sweep("swap")  # the previous save ended on every rank: its group is gone
        name = f"{self.name}/clique{self.members[0]}"
        transport.leave("swap", transport.group_keys(name, self.members.index(part.rank)))
        try:
            self.group = Group(name, self.members, part.rank, view.config.peer_timeout)
            infos = [records_from_json(b) for b in self.group.allgather(records_to_json(part.sealed()))]
            peers = {q: recs for q, recs in zip(self.members, infos, strict=True) if q in self.takes}
            wanted = self._claim(peers)  # this rank, or a member writing into this same root: not in peers
            asks = self.group.allgather(json.dumps({str(q): ids for q, ids in wanted.items()}).encode())
            mine = dedup.block_chunks(part.records)
            sends, recvs = [], []
            for q, records in peers.items():
                asked = json.loads(asks[self.members.index(q)]).get(str(part.rank), [])
                sends += [(q, as_bytes_tensor(c)) for c in part.stored]
                sends += [(q, as_bytes_tensor(b)) for block in asked for b in self._block_file(block, mine)]
                size = sum(r.part_length for r in records.values())
                res = part_file.reserve(view.config, view.own, self.step, q, size, POOL.mapped_inodes())
                landing = Landing(q, records, res, {})
                self.landed.append(landing)
                pos = 0
                for n in stored_chunk_sizes(records):
                    recvs.append((q, as_bytes_tensor(res.view[pos : pos + n])))
                    pos += n
                recvs += [(q, as_bytes_tensor(b)) for b in self._land_blocks(landing, wanted[q])]
            self.sent = sum(t.numel() for _, t in sends)
            self.works = self.group.post(sends, recvs)
        except BaseException:
            self.abort()
            raise
        return self

    def _claim(self, peers: dict[int, Records]) -> dict[int, list[str]]:
        """Claim in this root the blocks each peer's part uses; those it lacks, each asked of
        one peer only."""
        wanted: dict[int, list[str]] = {}
        asked: set[str] = set()
        for q, records in peers.items():
            ids = dedup.block_ids(records)
            if ids:
                dedup.claim(self.view, self.step, q, ids)
                self.here.update(dedup.holdings(self.view, (b for b in ids if b not in self.here)))
            wanted[q] = [b for b in ids if self.here[b] is None and b not in asked]
            asked.update(wanted[q])
        return wanted

    def _block_file(self, block: str, mine: dict[str, Chunk]) -> list[Buffer]:
        """A block a peer asked for, as this root holds it: header, then stored bytes. Zeros
        of its length where it cannot be read, so that the peer's check fails."""
        n = mine[block][0]
        got = dedup.block_file(self.view, self.part.blocks, block)
        if got is None or [len(memoryview(b).cast("B")) for b in got] != [BLOCK_HEADER, n]:
            return [bytes(BLOCK_HEADER), bytes(n)]
        return got

    def _land_blocks(self, landing: Landing, ids: list[str]) -> list[memoryview]:
        """Buffers for the blocks asked of a peer: each block's header and stored bytes."""
        chunks = dedup.block_chunks(landing.records)
        buf = memoryview(bytearray(sum(BLOCK_HEADER + chunks[b][0] for b in ids)))
        out, pos = [], 0
        for b in ids:
            end = pos + BLOCK_HEADER + chunks[b][0]
            landing.blocks[b] = buf[pos:end]
            out += [buf[pos : pos + BLOCK_HEADER], buf[pos + BLOCK_HEADER : end]]
            pos = end
        return out

    def finish(self) -> None:
        try:
            assert self.group is not None
            self.group.wait(self.works)
            self.works = []
            for land in self.landed:
                for rec in land.records.values():
                    if rec.blocks is not None:
                        continue
                    try:
                        verify_stored(rec, land.part.view[rec.offset : rec.offset + rec.length])
                    except ChecksumMismatch as e:
                        raise self._damaged(land.rank, e) from e
            self._write_blocks()
            ns = self.view.config.namespace
            for land in self.landed:
                land.part.commit()
                records = dedup.as_held(ns, land.records, self.here)
                write_index(self.view, self.step, land.rank, records, sum(map(len, land.blocks.values())))
            self.landed.clear()
        finally:
            self.abort()

    def _write_blocks(self) -> None:
        """Every block that arrived, verified and written into this root (in parallel)."""
        futures = []
        for land in self.landed:
            chunks = dedup.block_chunks(land.records)
            for b, data in land.blocks.items():
                futures.append((land.rank, b, pool().submit(dedup.land_block, self.view, b, data, chunks[b])))
        for q, b, fut in futures:
            try:
                self.here[b] = fut.result()
            except ChecksumMismatch as e:
                raise self._damaged(q, e) from e

    def _damaged(self, q: int, e: Exception) -> TieredCheckpointError:
        return TieredCheckpointError(f"step {self.step}: the replica of rank {q}'s part arrived damaged: {e}")

    def abort(self) -> None:
        """Drop the group (peers see it close) and any replica not committed yet."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.works = []
        for land in self.landed:
            land.part.discard()
        self.landed.clear()
