"""Executing a load plan: each item read from its route's sources, in fallback order.

``planners.load`` routes every item of DCP's ``LoadPlan`` (``plan_routes``, once per load,
from the opened step's ``sources``: ``open_step``) to its sources. ``StepReads`` reads each
item's leading own sources (this rank's own root of each node-local tier holding the
item's part, fastest first; alone, every tier holding the step), then runs the peer
exchange (``peer_exchange.PeerExchange``, collective) with what is still missing, serving what
peers ask of its own roots, then the remaining sources (shared tiers). An item is read
where its part's index in that root says (read once per opened step), straight into the
destination tensor when the stored chunk is exactly what is asked, else into a scratch
tensor that is narrowed. Every chunk is verified before the planner sees it; a failure
moves the item to its next source, with a warning naming the bad file. An item left with
no good copy fails the load, and quarantines the step (``OpenStep.quarantine``) when the
failures prove damage.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from tiered_dcp.planners.load import ItemRoute, ReadSource, plan_routes
from tiered_dcp.planners.routing import holds_stored_bytes, narrow_to_request
from tiered_dcp.storage import Storage
from tiered_dcp.storage.codec import ChecksumMismatch, chunk_spans, read_chunks, read_item
from tiered_dcp.storage.format import BadIndex, ItemInfo, ItemKey, PartIndex, Record, part_key

from ..errors import CheckpointCorruptError, NoCheckpointError, TieredCheckpointError
from ..ranks import transport
from ..ranks.transport import PeerTimeout
from ..steps import metadata as md_blob
from ..steps.catalog import StepCopy, TierView
from ..tensors import byte_tensor, byte_view, dtype_from_name
from . import device_reads, user_values
from .open_step import OpenStep
from .peer_exchange import ChunkReader, PeerExchange, PeerRequest, check_raw, chunk_reader, scratch
from .spread import KeepRaw, SpreadPlan, Transfer, exchange

log = logging.getLogger(__name__)


class Failed(Enum):
    """How one read of an item failed (its value: what the messages say)."""

    REMOVED = "was removed (the step is no longer committed there: another job's retention?)"
    DAMAGED = "is damaged"
    UNREADABLE = "could not be read"
    DAMAGED_IN_TRANSIT = "sent it damaged"


@dataclass(frozen=True)
class Failure:
    """One failed read of an item: where from, how, and the error's words."""

    where: str
    kind: Failed
    error: str

    def __str__(self) -> str:
        return f"{self.where} {self.kind.value}: {self.error}"


@dataclass
class _Attempt:
    """One item's read from one source: ``finish`` completes and commits it (raising what
    failed), ``drain`` waits for its work in flight without committing; ``nbytes`` is
    what it moves ahead of its ``finish`` (a device read's)."""

    finish: Callable[[], None]
    drain: Callable[[], None] = lambda: None
    nbytes: int = 0
    src: ReadSource | None = field(default=None, init=False)
    rec: Record | None = field(default=None, init=False)
    store: Storage | None = field(default=None, init=False)


def _row_bytes(dtype: torch.dtype, shape: list[int]) -> int:
    """Bytes of one row (dim 0) of a stored item; a scalar's one element."""
    return dtype.itemsize * math.prod(shape[1:])


def _land(lands: dict[int, torch.Tensor], req: PeerRequest) -> torch.Tensor:
    """Where a peer request's bytes are received: the target it lands in, else a fresh buffer."""
    target = lands.get(id(req))
    return scratch(req) if target is None else byte_tensor(target)


def cuda_ring(device: torch.device) -> device_reads.Ring | None:
    """The ring a target on ``device`` is read through: CUDA's; none for the host (or
    another device, read through the host)."""
    return device_reads.ring_for(device) if device.type == "cuda" else None


class StepReads:
    """The reads of one opened step (``open_step.OpenStep``): ``read_all`` executes a load plan.

    The parts' indexes it reads are kept for the step's later loads; ``failures`` (item ->
    what failed where) and the items no failure proved damaged are the last load's.
    """

    def __init__(self, opened: OpenStep) -> None:
        self._opened = opened
        self.config, self.rank, self.step = opened.config, opened.rank, opened.step
        self._views = opened.views
        self._metadata = opened.metadata
        self._held: dict[tuple[str, int, int], PartIndex | None] = {}  # (root, tier, part) -> index
        self.failures: dict[int, list[Failure]] = {}  # id(item) -> its failed reads, this load
        self._unproven: set[int] = set()  # items a failure other than damage kept from a source
        self.peer_reads = 0  # items this rank read from its own roots for peers, the last load
        self.read_from: dict[str, int] = {}  # source kind -> stored bytes of the items read, the last load
        # the ring a target's device is read through, None: the host path (tests put CPU
        # targets through a host ring, the device flow without a GPU)
        self.ring_for: Callable[[torch.device], device_reads.Ring | None] = cuda_ring

    def _routes(self, plan: LoadPlan) -> list[ItemRoute]:
        """The load plan (``planners.load``): every item's sources in fallback order."""
        md = self._metadata.cluster

        def part(req: ReadItem) -> int | None:
            info = None if md is None else md_blob.item_info(md, req.storage_index)
            return None if info is None else info.rank

        return plan_routes(self._opened.sources, ((req.storage_index, part(req)) for req in plan.items))

    def _part_index(
        self, view: TierView, store: Storage, copy: StepCopy, part: int, md: Metadata
    ) -> PartIndex | None:
        """Part's records in ``store``, or None when the root lacks it whole."""
        key = (store.url, view.index, part)
        if key not in self._held:
            index = None
            if view.part_present(store, copy.marker, part):
                index = view.part_index(store, copy.marker, part)
                if index is None and not copy.marker.has_indexes:  # format 1/2: the metadata's records
                    index = self._legacy_index(store, md, part)
            self._held[key] = index
        return self._held[key]

    def _legacy_index(self, store: Storage, md: Metadata, part: int) -> PartIndex | None:
        """Part's records in a format 1/2 step's metadata; None (damage) where one of them
        names what is no object of the layout (``PartIndex.check_names``)."""
        try:
            return md_blob.legacy_index(md, self.config.namespace, self.step, part)
        except BadIndex as e:
            log.warning("step %d: rank %d's part in %s counts as absent: %s", self.step, part, store.url, e)
            return None

    def _locate(self, src: ReadSource, req: ReadItem) -> tuple[Record, Storage] | None:
        copy = self._opened.copy_at[src.tier]
        md = self._metadata.of(copy)
        info = None if md is None else md_blob.item_info(md, req.storage_index)
        if md is None or info is None:
            return None
        view: TierView = self._views[copy.tier_index]
        # own root named: only it (peers serve what it lacks); else the root holding the part
        own_only = src.kind == "own" and src.root is not None
        store = view.own if own_only else view.part_store(copy.marker, info.rank)
        index = self._part_index(view, store, copy, info.rank, md)
        rec = None if index is None else index.records.get(md_blob.item_key(req.storage_index))
        if rec is not None and not rec.info.same_item(info):  # the metadata is checked, the index not
            log.warning(
                "step %d: item %r: the index of rank %d's part in %s disagrees with the metadata "
                "(its chunks, dtype or shape); trying another copy",
                self.step,
                req.storage_index.fqn,
                info.rank,
                store.url,
            )
            return None
        return None if rec is None else (rec, store)

    def _start(self, req: ReadItem, planner: LoadPlanner, rec: Record, store: Storage) -> _Attempt:
        """Start reading ``req`` from ``rec`` in ``store``: onto a CUDA target through its
        device's ring (``device_reads``), started now; else read on ``finish``."""
        if req.type == LoadItemType.BYTE_IO:
            return _Attempt(functools.partial(_read_bytes, req, planner, rec, store))
        target = planner.resolve_tensor(req).detach()
        dtype, shape = dtype_from_name(rec.info.dtype or ""), list(rec.info.shape or ())
        ring = self.ring_for(target.device)
        if ring is None:
            return _Attempt(functools.partial(_read_host, req, planner, rec, store, target, dtype, shape))
        land = device_reads.landing(req, target, dtype, shape)
        read = device_reads.DeviceRead(ring, store, rec, land, _row_bytes(dtype, shape))

        def finish() -> None:
            read.finish()
            planner.commit_tensor(req, target)

        return _Attempt(finish, read.drain, read.nbytes)

    def _next_attempt(
        self, req: ReadItem, planner: LoadPlanner, sources: Iterator[ReadSource]
    ) -> _Attempt | None:
        """The read of ``req`` from the next of ``sources`` that holds it, started."""
        for src in sources:
            located = self._locate(src, req)
            if located is not None:
                attempt = self._start(req, planner, *located)
                attempt.src, attempt.rec, attempt.store = src, *located
                return attempt
        return None

    def _failed(self, req: ReadItem, attempt: _Attempt, e: Exception) -> None:
        """Note why ``attempt`` failed, in the words the load's error and warnings use."""
        assert attempt.src is not None and attempt.rec is not None and attempt.store is not None
        where = attempt.store.describe(attempt.rec.file)
        view = self._views[attempt.src.tier]
        if isinstance(e, FileNotFoundError) and view.read_marker(attempt.store, self.step) is None:
            kind = Failed.REMOVED
            self._unproven.add(id(req))
        elif isinstance(e, ChecksumMismatch | FileNotFoundError):  # missing from a committed copy
            kind = Failed.DAMAGED
        else:  # a tier that failed to answer proves nothing about the bytes
            kind = Failed.UNREADABLE
            self._unproven.add(id(req))
        self.failures.setdefault(id(req), []).append(Failure(where, kind, str(e)))
        log.warning(
            "step %d: item %r in %s %s (%s); trying another copy",
            self.step,
            req.storage_index.fqn,
            where,
            kind.value,
            e,
        )

    def _count(self, kind: str, rec: Record | ItemInfo | None) -> None:
        """Count an item read (its stored bytes) against where it came from: ``own`` (this
        rank's roots), ``peer`` (another rank, over the exchange or the spread), ``shared``."""
        info = rec.info if isinstance(rec, Record) else rec
        self.read_from[kind] = self.read_from.get(kind, 0) + (0 if info is None else info.raw_length)

    def _read_direct(
        self, reqs: list[ReadItem], planner: LoadPlanner, sources: dict[int, tuple[ReadSource, ...]]
    ) -> list[ReadItem]:
        """Read each of ``reqs`` from the first of its ``sources`` (none a peer) that is good;
        return those left unread, in plan order.

        Reads onto a device are started ahead, up to ``device_reads.LOOKAHEAD_BYTES`` of
        them, and finished (committed) in plan order; a failed one starts the next source at
        once. Whatever happens, no read is still running when this returns.
        """
        left: list[ReadItem] = []
        started: deque[tuple[ReadItem, Iterator[ReadSource], _Attempt | None]] = deque()
        ahead = 0

        def finish_first() -> None:
            nonlocal ahead
            req, rest, attempt = started.popleft()
            ahead -= attempt.nbytes if attempt is not None else 0
            while attempt is not None:
                try:
                    attempt.finish()
                    self._count(attempt.src.kind, attempt.rec)
                    return
                except (ChecksumMismatch, OSError) as e:
                    self._failed(req, attempt, e)
                    attempt = self._next_attempt(req, planner, rest)
            left.append(req)

        try:
            for req in reqs:
                rest = iter(sources[id(req)])
                attempt = self._next_attempt(req, planner, rest)
                started.append((req, rest, attempt))
                ahead += attempt.nbytes if attempt is not None else 0
                while ahead > device_reads.LOOKAHEAD_BYTES:
                    finish_first()
            while started:
                finish_first()
        finally:
            for _, _, attempt in started:  # a load failing on its way: nothing lands after it
                if attempt is not None:
                    attempt.drain()
        order = {id(r): i for i, r in enumerate(reqs)}
        return sorted(left, key=lambda r: order[id(r)])

    # -- peers --------------------------------------------------------------------------

    def _next_peer(self, req: ReadItem, peers: Iterator[ReadSource]) -> tuple[int, PeerRequest] | None:
        """The next holder of ``req`` in its route's order (``planners.load``), as a request."""
        assert self._metadata.cluster is not None
        info = md_blob.item_info(self._metadata.cluster, req.storage_index)
        src = next(peers, None)
        if info is None or src is None or src.holder is None:
            return None
        chunks = tuple(n for n, _ in info.raw_chunks)
        return src.holder, PeerRequest(src.tier, info.rank, req.storage_index, info.raw_length, chunks)

    def _serve(self, req: PeerRequest) -> ChunkReader | None:
        """What reads the chunks of an item a peer asked of this rank's own root, each checked
        where it is read (False, with a warning, for one that fails); None when the item is
        not here whole."""
        self.peer_reads += 1
        view = self._views[req.tier_index]
        where = view.own.describe(part_key(self.config.namespace, self.step, req.part))

        def cannot(e: Exception) -> None:
            log.warning(
                "step %d: cannot serve item %r of rank %d's part from %s to a peer: %s",
                self.step,
                req.index.fqn,
                req.part,
                where,
                e,
            )

        try:
            own = self._opened.own[req.tier_index]  # asked only of ranks whose own root holds the part
            md = self._metadata.of(own)
            index = None if md is None else self._part_index(view, view.own, own, req.part, md)
            if index is None:
                raise KeyError("its part is not whole here")
            read = chunk_reader(view.own, index.records[md_blob.item_key(req.index)], req.chunks)
        except (OSError, KeyError) as e:
            cannot(e)
            return None

        def checked(j: int, out: torch.Tensor) -> bool:
            try:
                read(j, out)
                return True
            except (ChecksumMismatch, OSError) as e:
                cannot(e)
                return False

        return checked

    def _read_from_peers(
        self, pending: list[ReadItem], planner: LoadPlanner, routes: dict[int, ItemRoute]
    ) -> list[ReadItem]:
        """Fetch items from peers that hold them, round by round; return those still missing.

        Every rank takes part (it may have to serve) until no rank wants anything; an
        intact load ends after one round of store operations, no group opened. A peer
        that does not answer within ``peer_timeout`` ends the exchange for this rank: what
        is left is read from a shared tier holding the step.
        """
        assert self._metadata.cluster is not None
        peers = {id(r): iter(routes[id(r)].peers) for r in pending}  # each tried once, in order
        exchange = PeerExchange(
            self._opened.group_name, self.rank, dist.get_world_size(), self.config.peer_timeout
        )
        try:
            while True:
                wanted: dict[int, list[PeerRequest]] = {}
                asked_for: dict[int, ReadItem] = {}  # id(peer request) -> the item it is for
                lands: dict[int, torch.Tensor] = {}  # id(peer request) -> the target it lands in
                for req in pending:
                    found = self._next_peer(req, peers[id(req)])
                    if found is not None:
                        holder, peer_req = found
                        wanted.setdefault(holder, []).append(peer_req)
                        asked_for[id(peer_req)] = req
                        target = self._stored_as(req, planner)
                        if target is not None:
                            lands[id(peer_req)] = target
                arrived = exchange.round(wanted, self._serve, functools.partial(_land, lands))
                if arrived is None:
                    return pending
                done = set()
                try:  # each item checked and placed as it arrives
                    for holder, peer_req, buf in arrived:
                        req = asked_for[id(peer_req)]
                        info = md_blob.item_info(self._metadata.cluster, req.storage_index)
                        assert info is not None  # asked for only when the metadata knows it
                        try:
                            check_raw(info, buf)
                            if id(peer_req) in lands:  # it landed in the target itself
                                planner.commit_tensor(req, lands[id(peer_req)])
                            else:
                                self._deliver(req, planner, info, buf)
                            self._count("peer", info)
                        except ChecksumMismatch as e:
                            self.failures.setdefault(id(req), []).append(
                                Failure(f"rank {holder}", Failed.DAMAGED_IN_TRANSIT, str(e))
                            )
                            log.warning(
                                "step %d: item %r from rank %d arrived damaged (%s)",
                                self.step,
                                req.storage_index.fqn,
                                holder,
                                e,
                            )
                            continue
                        done.add(id(req))
                finally:  # a peer that stops answering mid-round: what arrived stays read
                    pending = [r for r in pending if id(r) not in done]
        except PeerTimeout as e:
            self._unproven.update(id(r) for r in pending)  # a peer that did not answer may hold them
            if pending:
                log.warning(
                    "step %d: a peer did not answer within %.0f s (%s); reading the %d item(s) "
                    "still missing from a shared tier",
                    self.step,
                    self.config.peer_timeout,
                    e,
                    len(pending),
                )
            return pending

    def _stored_as(self, req: ReadItem, planner: LoadPlanner) -> torch.Tensor | None:
        """``req``'s target when it is the stored item's raw bytes as they lie: an item from
        a peer is received into it (no scratch buffer, no copy); it is committed only once
        its checksum held, and an item that failed it is read again from its next source."""
        assert self._metadata.cluster is not None  # peers hold node-local copies
        info = md_blob.item_info(self._metadata.cluster, req.storage_index)
        if req.type != LoadItemType.TENSOR or info is None:
            return None
        target = planner.resolve_tensor(req).detach()
        if self.ring_for(target.device) is not None:  # a device's target: through its ring
            return None
        shape = list(info.shape or ())
        return target if holds_stored_bytes(req, target, dtype_from_name(info.dtype or ""), shape) else None

    def _deliver(self, req: ReadItem, planner: LoadPlanner, info: ItemInfo, buf: torch.Tensor) -> None:
        """Place a checked item that arrived whole in host memory (``buf``, its raw bytes) in
        its target: onto a device through the target's ring (``device_reads.from_host``),
        else by a host copy of the piece asked."""
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, user_values.checked(buf.numpy().tobytes()))
            return
        target = planner.resolve_tensor(req).detach()
        dtype, shape = dtype_from_name(info.dtype or ""), list(info.shape or ())
        ring = self.ring_for(target.device)
        if ring is not None:
            land = device_reads.landing(req, target, dtype, shape)
            device_reads.from_host(ring, buf, land, _row_bytes(dtype, shape))
            planner.commit_tensor(req, target)
            return
        _place(req, planner, buf.view(dtype).reshape(shape), target)

    def _read_spread(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        spread: SpreadPlan,
        split: dict[int, tuple[tuple[ReadSource, ...], tuple[ReadSource, ...]]],
    ) -> list[ReadItem]:
        """A load spread over the job (``spread.py``): this rank's own items and the items it
        reads for others (each read whole, once, its raw bytes kept until sent), then the
        exchange, then a read of its own of any item that arrived damaged. Returns the
        items left with no good copy."""
        sources = {key: s[0] + s[1] for key, s in split.items()}
        receiving, reading = spread.receives(self.rank), spread.reads_for_others(self.rank)
        asks: dict[ItemKey, list[ReadItem]] = {}
        for req in plan.items:
            asks.setdefault(md_blob.item_key(req.storage_index), []).append(req)
        keep = KeepRaw(planner, asks, self._item_info, _place)
        wholes = [keep.whole(key) for key in sorted(reading, key=lambda k: (k.fqn, k.offset or ()))]
        for whole in wholes:
            sources[id(whole)] = sources[id(asks[md_blob.item_key(whole.storage_index)][0])]
        elsewhere = receiving | reading
        own = [r for r in plan.items if md_blob.item_key(r.storage_index) not in elsewhere]
        pending = self._read_direct(own, planner, sources) + self._read_direct(wholes, keep, sources)
        damaged: list[ReadItem] = []

        def outgoing(t: Transfer) -> torch.Tensor:
            raw = keep.raw.pop(t.key, None)  # held only until its window is sent
            return (
                raw
                if raw is not None and raw.numel() == t.nbytes
                else torch.zeros(t.nbytes, dtype=torch.uint8)
            )

        def landing(t: Transfer) -> torch.Tensor:
            target = keep.exact(t.key)  # a device's target (a ring) gets it through the ring
            if target is None or self.ring_for(target.device) is not None:
                return torch.empty(t.nbytes, dtype=torch.uint8)
            return byte_tensor(target)

        def landed(t: Transfer, buf: torch.Tensor) -> None:
            info = self._item_info(t.key)
            try:
                check_raw(info, buf)
                for req in asks[t.key]:
                    target = planner.resolve_tensor(req).detach() if req.type == LoadItemType.TENSOR else None
                    if target is not None and target.data_ptr() == buf.data_ptr():  # it landed there
                        planner.commit_tensor(req, target)
                    else:
                        self._deliver(req, planner, info, buf)
                self._count("peer", info)
            except ChecksumMismatch as e:
                log.warning(
                    "step %d: item %r from rank %d arrived damaged or unread (%s); reading it here",
                    self.step,
                    t.key.fqn,
                    t.reader,
                    e,
                )
                damaged.extend(asks[t.key])

        try:
            exchange(
                self._opened.group_name,
                self.rank,
                spread,
                self.config.peer_timeout,
                outgoing,
                landing,
                landed,
            )
        except PeerTimeout as e:  # every rank's load fails: name the rank that stopped answering
            raise transport.lost(self.step, "the spread of the load's items", e) from e
        return pending + self._read_direct(damaged, planner, sources)

    def _item_info(self, key: ItemKey) -> ItemInfo:
        """What the metadata says of a stored item (one the plan asks for: it knows it)."""
        md = self._metadata.first(self._opened.copies, self._opened.quarantine)
        info = md_blob.item_info(md, md_blob.index_of(key))
        assert info is not None
        return info

    def read_all(self, plan: LoadPlan, planner: LoadPlanner, spread: SpreadPlan | None = None) -> None:
        """Execute the load plan: each item from its route's sources, in order.

        Its own roots first; then every rank takes part in the peer exchange (collective, so
        once for all items, whenever a node-local tier is pooled; it picks each item's
        holders in the route's order itself) with what is still missing; then the rest.
        With a ``spread`` (``spread.py``: a step on a shared tier, several ranks asking for
        the same items), this rank reads only the items no other rank reads for it, sends
        those it reads for others, and takes the rest from their readers.
        An item left with no good copy raises ``NoCheckpointError`` when every failure was a
        removal, else ``CheckpointCorruptError``, and quarantines the step unless a tier or
        peer failed to answer or a copy was removed (no proof of damage).
        """
        self.failures = {}
        self._unproven = set()
        self.peer_reads = 0
        self.read_from = {}
        routes = {id(req): r for req, r in zip(plan.items, self._routes(plan), strict=True)}
        split = {key: r.split_at_exchange() for key, r in routes.items()}
        if spread is not None:
            pending = self._read_spread(plan, planner, spread, split)
        else:
            pending = self._read_direct(plan.items, planner, {key: s[0] for key, s in split.items()})
            if self._opened.cluster:
                pending = self._read_from_peers(pending, planner, routes)
            pending = self._read_direct(pending, planner, {key: s[1] for key, s in split.items()})
        if pending:
            req = pending[0]
            failures = self.failures.get(id(req), [])
            detail = "; ".join(map(str, failures)) or "no tier or peer holds it"
            if failures and all(f.kind is Failed.REMOVED for f in failures):
                raise NoCheckpointError(
                    f"step {self.step} was removed from every tier it was being read from (a lease that "
                    f"expired, or another job's retention on a shared tier): {detail}"
                )
            why = (
                f"step {self.step}: no good copy of item {req.storage_index.fqn!r} "
                f"(offset {list(req.storage_index.offset or [])}) left"
                f"{f' (and {len(pending) - 1} more)' if len(pending) > 1 else ''}: {detail}"
            )
            if failures and not self._unproven.intersection(id(r) for r in pending):
                raise self._opened.quarantine(why)
            # a tier or peer that did not answer is no proof of damage: nothing is quarantined
            raise CheckpointCorruptError(f"{why}; {self._opened.next_choice()}", step=self.step)


def _read_bytes(req: ReadItem, planner: LoadPlanner, rec: Record, store: Storage) -> None:
    raw = bytearray(rec.info.raw_length)
    read_item(store, rec, memoryview(raw))
    planner.load_bytes(req, user_values.checked(raw))


def _read_host(
    req: ReadItem,
    planner: LoadPlanner,
    rec: Record,
    store: Storage,
    target: torch.Tensor,
    dtype: torch.dtype,
    shape: list[int],
) -> None:
    """Read ``req`` into a host (or non-CUDA) target: the stored item straight into the
    target's bytes when the target is it; else the chunks holding the rows asked for
    into a scratch tensor (one pass; the checksum reads it while it is warm), whose
    piece is copied into the target (the second)."""
    if holds_stored_bytes(req, target, dtype, shape):
        read_item(store, rec, byte_view(target))
        planner.commit_tensor(req, target)
        return
    (r0, r1), inner = device_reads.rows_asked(req, shape)
    row = _row_bytes(dtype, shape)
    spans = chunk_spans(rec)
    lo, hi = r0 * row, r1 * row
    wanted = [i for i, (at, n, _) in enumerate(spans) if at < hi and at + n > lo] or [0]
    base = spans[wanted[0]][0]
    end = spans[wanted[-1]][0] + spans[wanted[-1]][1]
    scratch = torch.empty(end - base, dtype=torch.uint8)
    read_chunks(store, rec, wanted[0], wanted[-1] + 1, byte_view(scratch))
    rows = scratch[lo - base : hi - base].view(dtype).reshape(device_reads.rows_shape((r0, r1), shape))
    target.copy_(device_reads.narrowed(rows, inner, target))
    planner.commit_tensor(req, target)


def _place(req: ReadItem, planner: LoadPlanner, full: torch.Tensor, target: torch.Tensor) -> None:
    """Copy the requested piece of a whole stored item into the target and commit it."""
    piece = narrow_to_request(full, req)
    if piece.size() != target.size():
        raise TieredCheckpointError(
            f"item {req.storage_index.fqn}: stored piece {tuple(piece.size())} does not "
            f"fit the target {tuple(target.size())}"
        )
    target.copy_(piece)
    planner.commit_tensor(req, target)
