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
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tiered_dcp.storage.base import Buffer, Reservation
from tiered_dcp.storage.blocks import hashing, pool
from tiered_dcp.storage.codec import ChecksumMismatch, checksum, verify_stored
from tiered_dcp.storage.format import BLOCK_HEADER, Chunk, Record, write_index
from tiered_dcp.storage.records import (
    MAX_BYTES,
    MAX_PART_BYTES,
    MAX_PART_CHUNKS,
    STORED_CHUNK_BYTES,
    DamagedRecord,
    json_object,
    parse_json,
    short_list,
    short_text,
    shown,
    whole_numbers,
)

from ..errors import TieredCheckpointError
from ..ranks import transport
from ..ranks.cliques import Layout
from ..ranks.transport import Group, as_bytes_tensor
from ..ranks.worlds import Op
from ..steps import dedup, part_file
from ..steps.catalog import TierView
from ..steps.metadata import Records, part_index, records_from_json, records_to_json
from .staging import POOL

log = logging.getLogger(__name__)


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

    def seal(self) -> Records:
        """Its records: ``records`` once ``pending`` (which waits for the checksums) ran."""
        if self.pending is not None:
            self.records, self.pending = self.pending(), None
        return self.records


@dataclass
class Landing:
    """A peer's part arriving in this root: its part file, and the blocks this root lacked.

    ``records`` are its block records (the peer names its blocks before it sends) until
    ``Swap.finish`` replaces them with all its records; ``sizes`` its part file's stored
    chunks as it announced them, each received on its own and hashed as it lands
    (``arrived``: (start, length) -> the checksum's future)."""

    rank: int
    records: Records  # as the peer's root holds them
    part: Reservation
    blocks: dict[str, memoryview]  # block id -> its file's bytes (header, stored), as sent
    sizes: list[int] = dataclasses.field(default_factory=list)
    receiving: list[tuple[int, int, Any]] = dataclasses.field(default_factory=list)  # (start, length, work)
    arrived: dict[tuple[int, int], Future[int]] = dataclasses.field(default_factory=dict)

    def wait_hashed(self) -> None:
        """Wait for the hashing of its chunks (none may read the file once it is released)."""
        for fut in self.arrived.values():
            if not fut.cancel():
                fut.exception()


def write_records_index(
    view: TierView, step: int, rank: int, records: Records, written: int | None = None
) -> None:
    """Rank's index next to its part (or replica) in this rank's own root."""
    index = part_index(rank, records)
    if written is not None:
        index = dataclasses.replace(index, written=index.size + written)
    write_index(view.own, view.config.namespace, step, index)


def stored_chunk_sizes(records: Records) -> list[int]:
    """The stored length of every chunk of a part file, in file order (blocks are not in it)."""
    in_file = sorted((r for r in records.values() if r.blocks is None), key=lambda r: r.offset)
    return [n for rec in in_file for n in rec.stored]


def _describes(records: Records, land: Landing) -> bool:
    """Whether a peer's records describe what it announced: its part file's chunks, and the
    blocks (with their lengths and checksums) it named and this root claimed. Aliases (the
    save planner's) are records of their own over blocks already named."""
    return stored_chunk_sizes(records) == land.sizes and dedup.block_chunks(records) == dedup.block_chunks(
        land.records
    )


class Swap:
    """This rank's part swapped with its clique's members on other roots, theirs landing here.

    ``start`` posts the transfers (they run in gloo's threads while the rank writes its own
    part); ``finish`` waits, verifies every replica against its checksums and renames it
    clean with its index. Any failure discards the landed replicas.

    The bytes travel before their checksums are known: a member first announces its part
    file's chunk sizes and its block records (``layout``), which is all a peer needs to
    receive them, and sends; its checksums are computed meanwhile, on its hashing threads,
    and its records follow in ``finish``. The receiver hashes each chunk as it lands, while
    the next ones arrive, and checks those checksums against the records when they come
    (``_verify``): the bytes are not passed over again after the transfer.

    What travels to a peer is its part file, then the block files its root lacks: the peer
    first claims every block the part uses (``dedup.claim``: its list before the GC lease,
    as a save does), then says which it lacks, so the blocks it holds are never sent.
    ``sent`` counts the bytes this rank sent.
    """

    def __init__(
        self, view: TierView, step: int, part: SavedPart, world: list[int], op: Op, layout: Layout
    ) -> None:
        self.view, self.step, self.part = view, step, part
        self.members = layout.clique(part.rank)
        self.world, self.op = world, op
        self.takes = view.placement.parts_written_by(part.rank, dict(enumerate(world)), layout)[1:]
        self.landed: list[Landing] = []
        self.here: dict[str, dedup.Held | None] = {}  # the blocks the peers' parts use, in this root
        self.group: Group | None = None
        self.works: list[Any] = []
        self.sent = 0

    def layout(self) -> bytes:
        """What a peer needs to receive this rank's part: its part file's chunk sizes, in
        file order, and its block records (named before the rest of its checksums)."""
        sizes = [memoryview(c).nbytes for c in self.part.stored]
        return json.dumps({"sizes": sizes, "blocks": records_to_json(self.part.records).decode()}).encode()

    def start(self) -> Swap:
        view, part = self.view, self.part
        name = self.op.key(f"clique{self.members[0]}")
        self.op.sweep_later(transport.group_keys(name, self.members.index(part.rank)))
        try:
            self.group = Group(name, self.members, part.rank, view.config.peer_timeout)
            layouts = self.group.allgather(self.layout())
            announced = [_announced(b, q) for b, q in zip(layouts, self.members, strict=True)]
            peers = {q: a for q, a in zip(self.members, announced, strict=True) if q in self.takes}
            wanted = self._claim({q: records for q, (_, records) in peers.items()})
            asks = self.group.allgather(json.dumps({str(q): ids for q, ids in wanted.items()}).encode())
            mine = dedup.block_chunks(part.records)
            sends = []
            for q in peers:
                asked = json.loads(asks[self.members.index(q)]).get(str(part.rank), [])
                sends += [(q, as_bytes_tensor(c)) for c in part.stored]
                sends += [(q, as_bytes_tensor(b)) for block in asked for b in self._block_file(block, mine)]
            self.sent = sum(t.numel() for _, t in sends)
            self.works = self.group.post(sends, [])
            for q, (sizes, records) in peers.items():
                res = part_file.reserve(view.config, view.own, self.step, q, sum(sizes), POOL.mapped_inodes())
                landing = Landing(q, records, res, {}, sizes)
                self.landed.append(landing)
                pos = 0
                for n in sizes:  # one by one: each is hashed as it lands (``_receive``)
                    for _, work in self.group.post([], [(q, as_bytes_tensor(res.view[pos : pos + n]))]):
                        landing.receiving.append((pos, n, work))
                    pos += n
                blocks = [(q, as_bytes_tensor(b)) for b in self._land_blocks(landing, wanted[q])]
                self.works += self.group.post([], blocks)
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
            self._receive()
            self.op.check("the replica exchange")
            sealed = self.group.allgather(records_to_json(self.part.seal()))
            for land in self.landed:
                records = records_from_json(sealed[self.members.index(land.rank)])
                if not _describes(records, land):
                    raise self._damaged(land.rank, ValueError("its records do not describe what it sent"))
                land.records = records
                for rec in records.values():
                    if rec.blocks is None:
                        try:
                            _verify(land, rec)
                        except ChecksumMismatch as e:
                            raise self._damaged(land.rank, e) from e
            self._write_blocks()
            while self.landed:
                self._commit(self.landed[0])
        finally:
            self.abort()

    def _commit(self, land: Landing) -> None:
        """Rename a verified replica clean, then write its index. It leaves ``landed`` as it
        commits: a failure after that (its index, the next replica) discards only the rest."""
        land.wait_hashed()
        land.part.commit()
        self.landed.remove(land)
        records = dedup.as_held(self.view.config.namespace, land.records, self.here)
        write_records_index(self.view, self.step, land.rank, records, sum(map(len, land.blocks.values())))

    def _receive(self) -> None:
        """Wait for every transfer, hashing each chunk of a replica's part file as it lands
        (on ``hashing``'s threads, while the next ones arrive). Each chunk has the peer
        timeout to arrive: a peer that goes on sending is not a lost one."""
        assert self.group is not None
        for land in self.landed:
            for start, n, work in land.receiving:
                self.group.wait([(land.rank, work)])
                land.arrived[(start, n)] = hashing().submit(checksum, land.part.view[start : start + n])
            land.receiving = []
        self.group.wait(self.works)
        self.works = []

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
            land.wait_hashed()
            land.part.discard()
        self.landed.clear()


def _announced(blob: bytes, rank: int) -> tuple[list[int], Records]:
    """Rank's ``Swap.layout``: its part file's chunk sizes and its block records, bounded
    as what a tier holds is (``records``): this rank reserves what a peer announces."""
    try:
        doc = json_object(parse_json(blob, "the layout"), "the layout", {"sizes", "blocks"})
        blocks = records_from_json(short_text(doc["blocks"], "its block records", MAX_BYTES).encode())
        sizes = _part_sizes(doc["sizes"], blocks)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise TieredCheckpointError(
            f"rank {rank}'s part layout for the replica exchange could not be read "
            f"({type(e).__name__}: {str(e)[:200]}): run the same tiered-dcp version on every rank of the job"
        ) from e
    return sizes, blocks


def _part_sizes(sizes: Any, blocks: Records) -> list[int]:
    """The announced chunk sizes, if they are a part's: each a whole number no larger than
    a stored chunk, and with the blocks it names no more chunks or bytes than a part holds
    (``MAX_PART_CHUNKS``, ``MAX_PART_BYTES``). DamagedRecord otherwise."""
    sizes = short_list(sizes, "the chunk sizes", MAX_PART_CHUNKS)
    if not whole_numbers(sizes) or max(sizes, default=0) > STORED_CHUNK_BYTES:
        bad = next(n for n in sizes if type(n) is not int or not 0 <= n <= STORED_CHUNK_BYTES)
        raise DamagedRecord(f"a chunk size must be a whole number to {STORED_CHUNK_BYTES}, not {shown(bad)}")
    held = [stored for stored, _, _ in dedup.block_chunks(blocks).values()]
    count, total = len(sizes) + len(held), sum(sizes) + sum(held)
    if count > MAX_PART_CHUNKS or total > MAX_PART_BYTES:
        raise DamagedRecord(
            f"{count} chunks of {total} bytes, more than a part holds "
            f"({MAX_PART_CHUNKS} chunks, {MAX_PART_BYTES} bytes)"
        )
    return sizes


def _verify(land: Landing, rec: Record) -> None:
    """Check one record of a landed part: a raw one against the checksums its chunks got as
    they landed (a chunk the record cuts otherwise is hashed here), any other decoded."""
    stored = land.part.view[rec.offset : rec.offset + rec.length]
    if rec.codec != "raw" or rec.codecs is not None:
        verify_stored(rec, stored)
        return
    if len(stored) != rec.length:
        raise ChecksumMismatch(f"{len(stored)} bytes where the record says {rec.length}")
    if rec.length != rec.info.raw_length:
        raise ChecksumMismatch(f"a raw record of {rec.length} bytes, its chunks {rec.info.raw_length}")
    pos = rec.offset
    for i, (n, h) in enumerate(rec.info.raw_chunks):
        got = land.arrived.get((pos, n))
        value = got.result() if got is not None else checksum(land.part.view[pos : pos + n])
        if value != h:
            at = pos - rec.offset
            raise ChecksumMismatch(f"chunk {i} (bytes {at}..{at + n} of the item)")
        pos += n
