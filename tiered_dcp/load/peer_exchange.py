"""The load side of node-local tiers: what the cluster still holds, and reads from peers.

Each rank looks only at its own root of each node-local tier (a real node sees no other
node's disks) and tells the others which parts of which steps it holds. A step is
complete *in the cluster* when the union of those holdings covers every part of one
save (same metadata checksum) and someone still has its metadata. Items a rank's own root
lacks (its node was wiped or replaced, or its copy is damaged) are read from a peer that
holds them (``PeerExchange``), round by round until none is missing: the wish lists go
through the job's store, the bytes over gloo groups of two, opened only between a rank
and a holder it asks.
"""

from __future__ import annotations

import datetime
import json
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import CHUNK_BYTES, ChecksumMismatch, read_chunk_into, verify_raw
from tiered_dcp.storage.format import ItemInfo, ItemKey, Record, metadata_key

from ..ranks import transport, worlds
from ..ranks.transport import Group, PeerTimeout
from ..steps.catalog import TierView
from ..steps.choice import StepMarks, replica_marks
from ..steps.metadata import index_of, item_key
from ..tensors import byte_view

_WANTS = 1 << 32  # a rank that wants something adds 1 + _WANTS to a round's counter, others 1


@dataclass
class Holding:
    """What one rank's own root of one node-local tier holds of one committed step."""

    ident: int  # the metadata's checksum: the same on every node for one save
    world_size: int
    parts: set[int]
    metadata: bool
    nonfinite_items: int = 0  # the marker's: items saved holding NaN/Inf
    nonfinite: tuple[str, ...] = ()
    legacy: bool = False  # format 1/2: its metadata (and so ``ident``) differs per tier
    replicas: tuple = (0, (), ())  # the marker's replicas that disagreed (``choice.replica_marks``)


@dataclass
class ClusterCopy:
    """A step complete in the union of the ranks' own roots of one node-local tier."""

    tier_index: int
    step: int
    ident: int
    holders: dict[int, list[int]]  # part rank -> current ranks whose own root holds it
    metadata_at: list[int] = field(default_factory=list)  # ranks whose root has the metadata
    marks: StepMarks | None = None  # quarantined (a mark in any rank's root), non-finite, replicas
    legacy: bool = False  # a format 1/2 step (``Holding.legacy``)
    world_size: int = 0  # the save's, as its markers say

    @property
    def step_marks(self) -> StepMarks:
        return self.marks or StepMarks(self.step)


def own_holdings(view: TierView) -> dict[int, Holding]:
    store = view.own
    out = {}
    for step in view.step_dirs(store):
        marker = view.read_marker(store, step)
        if marker is None:
            continue
        md_ok = store.size(metadata_key(view.config.namespace, step)) == marker.metadata_size
        parts = {p.rank for p in marker.parts if view.part_present(store, marker, p.rank)}
        nonfinite = marker.nonfinite_items, tuple(marker.nonfinite)
        legacy = not marker.has_indexes
        out[step] = Holding(
            marker.metadata_xxh3, marker.world_size, parts, md_ok, *nonfinite, legacy, replica_marks(marker)
        )
    return out


def own_marks(view: TierView) -> dict[tuple[int, int], str]:
    """(step, ident) -> why, for the quarantine marks in this rank's own root (as its last
    listing, ``own_holdings``'s, shows them: a mark may name a step the root no longer holds)."""
    store = view.own
    found = {}
    for step, ident in view.marks.get(store.url, {}):
        found[(step, ident)] = view.quarantined(store, step, ident) or ""
    return found


def holdings_to_json(holdings: dict[int, Holding]) -> dict[str, list]:
    """A rank's holdings as plain data, for the all-gather: what a peer sends is never code."""
    return {
        str(s): [
            h.ident,
            h.world_size,
            sorted(h.parts),
            h.metadata,
            h.nonfinite_items,
            list(h.nonfinite),
            h.legacy,
            [h.replicas[0], list(h.replicas[1]), list(h.replicas[2])],
        ]
        for s, h in holdings.items()
    }


def holdings_from_json(doc: dict[str, list]) -> dict[int, Holding]:
    return {
        int(s): Holding(
            int(i),
            int(w),
            {int(p) for p in parts},
            bool(m),
            int(n),
            tuple(str(x) for x in names),
            bool(old),
            (int(r), tuple(str(x) for x in rnames), tuple(int(x) for x in ranks)),
        )
        for s, (i, w, parts, m, n, names, old, (r, rnames, ranks)) in doc.items()
    }


def marks_to_json(marks: dict[tuple[int, int], str]) -> list[list]:
    return [[s, i, why] for (s, i), why in sorted(marks.items())]


def marks_from_json(doc: list[list]) -> dict[tuple[int, int], str]:
    return {(int(s), int(i)): str(why) for s, i, why in doc}


def cluster_copies(
    tier_index: int, gathered: list[dict[int, Holding]], marks: dict[tuple[int, int], str] | None = None
) -> tuple[dict[int, ClusterCopy], dict]:
    """Steps complete in the union of every rank's holdings; for the rest, the parts lost.

    ``marks``: every rank's quarantine marks pooled ((step, ident) -> why); a step complete
    in the cluster carries them, and its marker's non-finite items and replicas that
    disagreed (``ClusterCopy.marks``).
    """
    saves: dict[tuple[int, int], ClusterCopy] = {}
    sizes: dict[tuple[int, int], int] = {}
    marks = marks or {}
    for rank, holdings in enumerate(gathered):
        for step, h in holdings.items():
            c = saves.setdefault((step, h.ident), ClusterCopy(tier_index, step, h.ident, {}))
            c.legacy = c.legacy or h.legacy
            if c.marks is None:
                why = marks.get((step, h.ident))
                c.marks = StepMarks(step, why, h.nonfinite_items, h.nonfinite, *h.replicas)
            sizes[(step, h.ident)] = c.world_size = h.world_size
            for p in sorted(h.parts):
                c.holders.setdefault(p, []).append(rank)
            if h.metadata:
                c.metadata_at.append(rank)
    complete: dict[int, ClusterCopy] = {}
    lost: dict[int, list[int]] = {}
    for key, c in saves.items():
        missing = sorted(set(range(sizes[key])) - set(c.holders))
        if not missing and c.metadata_at:
            complete[c.step] = c
        else:
            lost[c.step] = missing
    return complete, {s: m for s, m in lost.items() if s not in complete}


@dataclass
class PeerRequest:
    """One item this rank wants from a peer: where it is and how long its raw bytes are."""

    tier_index: int
    part: int
    index: MetadataIndex
    length: int
    chunks: tuple[int, ...]  # its raw chunks' lengths, as the requester's metadata says: one message each

    @property
    def order(self) -> tuple:
        """The order both sides list an item in: a holder sends, and its requester receives,
        each pair's items sorted by it (so an item several ranks ask for is read once)."""
        i = self.index
        return self.tier_index, self.part, i.fqn, tuple(i.offset or ()), i.index or 0

    def to_json(self) -> list:
        return [self.tier_index, self.part, item_key(self.index).to_json(), self.length, list(self.chunks)]

    @classmethod
    def from_json(cls, v: list) -> PeerRequest:
        tier_index, part, key, length, chunks = v
        index = index_of(ItemKey.from_json(key))
        return cls(int(tier_index), int(part), index, int(length), tuple(int(n) for n in chunks))


ChunkReader = Callable[[int, torch.Tensor], bool]  # chunk j into a buffer of its length: read and checked?


def chunk_reader(store: Storage, rec: Record, chunks: Sequence[int]) -> Callable[[int, torch.Tensor], None]:
    """Reads chunk ``j`` of an item from this rank's own root into ``out`` (its raw length),
    decoded and verified (``read_chunk_into``: ChecksumMismatch, OSError), for a peer that
    asked for it by ``chunks``; KeyError when the item is chunked otherwise here."""
    if [n for n, _ in rec.info.raw_chunks] != list(chunks):
        raise KeyError(f"its chunks here are {[n for n, _ in rec.info.raw_chunks]}, not {list(chunks)}")
    return lambda j, out: read_chunk_into(store, rec, j, byte_view(out))


class SendRing:
    """The buffers a rank sends items from, chunk by chunk: ``slots`` of ``slot_bytes``, a
    slot taken again only once its send ran. A rank serving a lost node's parts holds these
    (32 MiB), not the parts it sends (a survivor of 8 ranks serving 8 replicas of a few GB
    would hold them all at once)."""

    def __init__(self, slots: int = 4, slot_bytes: int = CHUNK_BYTES) -> None:
        self.slots, self.slot_bytes = slots, slot_bytes
        self._free: list[torch.Tensor] = []
        self._busy: deque[tuple[torch.Tensor, list[tuple[Group, list]]]] = deque()
        self.made = 0  # slots allocated (tests)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (a one-off for a chunk larger than a slot)."""
        if nbytes > self.slot_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        if not self._free and self.made < self.slots:
            self.made += 1
            self._free.append(torch.empty(self.slot_bytes, dtype=torch.uint8))
        while not self._free:
            self._recycle()
        return self._free.pop()

    def sent(self, buf: torch.Tensor, sends: list[tuple[Group, list]]) -> None:
        """``buf`` (as ``take`` gave it) is being sent (each group's works): taken again
        once they all ran."""
        self._busy.append((buf, sends))

    def _recycle(self) -> None:
        buf, sends = self._busy.popleft()
        for group, works in sends:
            group.wait(works)
        if buf.numel() == self.slot_bytes:  # a one-off goes
            self._free.append(buf)

    def finish(self) -> None:
        """Wait for every send still running."""
        while self._busy:
            self._recycle()


def scratch(req: PeerRequest) -> torch.Tensor:
    """A fresh buffer for a requested item's bytes."""
    return torch.empty(req.length, dtype=torch.uint8)


class PeerExchange:
    """One load's peer reads, round by round, with no step that grows with the world.

    Per round, a rank appends its wish list for each holder it asks to that holder's key
    and adds itself to the round's counter; the rank whose add completes the world sets the
    round's verdict (how many ranks want anything), for which the others wait. That is
    O(1) store operations per rank plus one per holder asked, and nobody reads keys of
    ranks it has nothing to do with. When nobody wants anything (an intact load, or the
    last round) the exchange ends on every rank, no group opened. Otherwise each rank opens
    a 2-member gloo group with every rank it asks or is asked by for at least one byte
    (``_crosses``), in one global order of pairs (so no two ranks wait on each other), and
    the bytes move over those.

    Every rank deletes the keys it wrote (the gloo groups' included) at its next load's
    exchange: the reader's constructor is a collective, so by then every rank has left this
    one. A job thus keeps at most one load's keys.
    """

    def __init__(self, name: str, rank: int, world: int, timeout: float) -> None:
        self.name, self.rank, self.world, self.timeout = name, rank, world, timeout
        self.rounds = 0
        self.store = worlds.store()
        worlds.sweep("load")

    def round(
        self,
        wanted: dict[int, list[PeerRequest]],
        serve: Callable[[PeerRequest], ChunkReader | None],
        landing: Callable[[PeerRequest], torch.Tensor] = scratch,
    ) -> Iterator[tuple[int, PeerRequest, torch.Tensor]] | None:
        """Ask for ``wanted`` (holder -> requests), serve what others ask of this rank.

        Returns what arrives for ``wanted``, unverified (holder, request,
        bytes: the tensor ``landing`` gave for the request, ``req.length`` bytes; by default
        a fresh one), each as soon as it is in, each holder's in ``PeerRequest.order``, or
        None when no rank wants anything: the exchange
        is over on every rank. Iterate it to its end (a rank that only serves too): its sends
        are waited for and its groups closed there. An item a holder cannot read arrives as
        zeros, so that it fails the check. Raises PeerTimeout (iterating, too).
        """
        name = f"{self.name}/round{self.rounds}"
        self.rounds += 1
        if not self._anyone_wants(name, wanted):
            return None
        return self._move(name, wanted, self._asked_of_me(name), serve, landing)

    def _anyone_wants(self, name: str, wanted: dict[int, list[PeerRequest]]) -> bool:
        for holder, reqs in wanted.items():
            key = f"{name}/ask/{holder}"
            worlds.sweep_later("load", [key])
            line = json.dumps([self.rank, [r.to_json() for r in reqs]], separators=(",", ":"))
            self.store.append(key, line.encode() + b"\n")  # JSON escapes newlines: one line each
        counter, verdict = f"{name}/arrived", f"{name}/wanting"
        worlds.sweep_later("load", [counter])
        arrived = self.store.add(counter, 1 + (_WANTS if wanted else 0))
        if arrived % _WANTS == self.world:  # the last to arrive: every wish list is in
            worlds.sweep_later("load", [verdict])
            self.store.set(verdict, str(arrived // _WANTS))
        try:
            self.store.wait([verdict], datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            raise PeerTimeout(
                f"not every rank reached {name} of the peer reads within {self.timeout:.0f} s: {e}"
            ) from e
        return int(self.store.get(verdict)) > 0

    def _asked_of_me(self, name: str) -> list[tuple[int, list[PeerRequest]]]:
        """(requester, requests) for every rank that asked this one in round ``name``."""
        key = f"{name}/ask/{self.rank}"
        if not self.store.check([key]):
            return []
        asked = []
        for line in self.store.get(key).splitlines():  # one JSON line per requester, appended
            requester, reqs = json.loads(line)
            asked.append((int(requester), [PeerRequest.from_json(r) for r in reqs]))
        return asked

    def _move(
        self,
        name: str,
        wanted: dict[int, list[PeerRequest]],
        asked: list[tuple[int, list[PeerRequest]]],
        serve: Callable[[PeerRequest], ChunkReader | None],
        landing: Callable[[PeerRequest], torch.Tensor],
    ) -> Iterator[tuple[int, PeerRequest, torch.Tensor]]:
        """Open the groups, post every receive (an item's chunks straight into its landing),
        then read and send each item asked of this rank chunk by chunk through a ``SendRing``
        (each chunk's transfer overlaps the next chunk's read); the arrivals follow
        (``_arrivals``)."""
        partners = {h for h, reqs in wanted.items() if any(map(_crosses, reqs))}
        partners |= {requester for requester, reqs in asked if any(map(_crosses, reqs))}
        groups: dict[int, Group] = {}
        try:
            for pair in sorted(tuple(sorted((self.rank, p))) for p in partners):
                group_name = f"{name}/pair{pair[0]}-{pair[1]}"
                worlds.sweep_later("load", transport.group_keys(group_name, pair.index(self.rank)))
                peer = pair[1] if pair[0] == self.rank else pair[0]
                groups[peer] = Group(group_name, pair, self.rank, self.timeout)
            receives = []
            for holder, reqs in wanted.items():
                group = groups.get(holder)  # None: nothing of it crosses (every item empty)
                for req in sorted(reqs, key=lambda r: r.order):  # as the holder sends them
                    buf = landing(req)
                    pieces = [(holder, buf[a : a + n]) for a, n in _spans(req.chunks)]
                    works = group.post([], pieces) if group else []
                    receives.append((group, works, (holder, req, buf)))
            ring = SendRing()
            by_item: dict[tuple, list[tuple[int, PeerRequest]]] = {}  # each pair's items in order
            for requester, reqs in asked:
                for req in reqs:
                    by_item.setdefault(req.order, []).append((requester, req))
            for order in sorted(by_item):  # an item several ranks ask for is read once
                for wave in _waves(by_item[order]):
                    _send(groups, wave, serve(wave[0][1]), ring)
        except BaseException:
            for group in groups.values():
                group.close()
            raise
        return self._arrivals(groups, receives, ring)

    @staticmethod
    def _arrivals(
        groups: dict[int, Group],
        receives: list[tuple[Group | None, list, tuple[int, PeerRequest, torch.Tensor]]],
        ring: SendRing,
    ) -> Iterator[tuple[int, PeerRequest, torch.Tensor]]:
        """Each received item as soon as it is in (the caller checks and places it while the
        next one arrives, where it waited for the last one before), then this rank's sends
        waited for; the groups are closed at the end, or when the caller stops early."""
        try:
            for group, works, arrived in receives:
                if works:
                    group.wait(works)
                yield arrived
            ring.finish()
        finally:
            for group in groups.values():
                group.close()


def _crosses(req: PeerRequest) -> bool:
    """Whether any byte of ``req`` moves between the ranks: a group opens only for those
    (one that nothing crosses may be closed by its member done first while the other is
    still connecting, which fails the other's setup)."""
    return any(req.chunks)


def _spans(chunks: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(start, length) of each chunk of an item's raw bytes."""
    at = 0
    for n in chunks:
        yield at, n
        at += n


def _waves(asks: list[tuple[int, PeerRequest]]) -> Iterator[list[tuple[int, PeerRequest]]]:
    """An item's asks in waves with each requester at most once: a rank asking for the same
    item twice (two of its targets) receives all of the first copy's chunks, then the
    second's, as it posted its receives, where one wave would interleave them."""
    while asks:
        wave, seen, rest = [], set(), []
        for requester, req in asks:
            (rest if requester in seen else wave).append((requester, req))
            seen.add(requester)
        yield wave
        asks = rest


def _send(
    groups: dict[int, Group], asks: list[tuple[int, PeerRequest]], read: ChunkReader | None, ring: SendRing
) -> None:
    """Send one item to every (requester, request) of ``asks``, chunk by chunk: each chunk
    read once into a ring buffer and posted to all as soon as it is read; from a chunk that
    could not be read on, zeros (the requesters' checks fail, and they ask the next holder)."""
    for j, (_, n) in enumerate(_spans(asks[0][1].chunks)):
        if not n:
            continue  # nothing crosses (of an empty item, its requesters may have no group with us)
        slot = ring.take(n)
        buf = slot[:n]
        if read is not None and not read(j, buf):
            read = None  # this chunk and the rest go as zeros
        if read is None:
            buf.zero_()
        ring.sent(slot, [(groups[r], groups[r].post([(r, buf)], [])) for r, _ in asks])


def check_raw(info: ItemInfo, buf: torch.Tensor) -> None:
    """Verify bytes a peer sent against the metadata's chunk checksums."""
    view = memoryview(buf.numpy()).cast("B") if buf.numel() else memoryview(b"")
    if len(view) != info.raw_length:
        raise ChecksumMismatch(f"{len(view)} bytes where {info.raw_length} were expected")
    verify_raw(info, view)
