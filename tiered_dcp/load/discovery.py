"""A load's look at the shared tiers, made once for the whole job and handed to every rank.

Were every rank to find the newest complete step of a bucket itself, the bucket's requests
would grow with the square of the job (each rank asking after each part). Instead rank 0
asks (``choice.newest_complete``: the namespace listing, a marker, one listing of the
step's directory with sizes), reads the chosen step's metadata, and hands both to the other
ranks over the process group as plain bytes: JSON, and the metadata blob that every rank
loads through the allowlisting unpickler (``metadata.loads``). Nothing another process
sends is unpickled as it is. The other ranks then read only the indexes and byte ranges of
the items they load.

The load holds one lease on a shared tier, rank 0's, given back when every rank has read
(``all_read``): a store counter, no request to the bucket.

Every collective a load runs over the process group outside DCP is one of this module's
functions: ``broadcast_bytes``, ``all_gather_bytes`` and ``all_agree`` (whether the step was
leased on every rank, and whether every rank read its metadata from its own root). The peer
exchange (``peer_exchange.PeerExchange``) agrees through the job's store instead, and moves
bytes only within groups of two ranks, bounded by ``peer_timeout``.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from tiered_dcp.storage.format import Marker

from ..ranks import worlds
from ..steps.catalog import StepCopy, TierView
from ..steps.choice import Found, StepMarks, newest_complete

log = logging.getLogger(__name__)

READ_WAIT = 1800.0  # seconds rank 0 waits for the others' reads before it gives its lease back


def broadcast_bytes(blob: bytes | None, src: int = 0) -> bytes:
    """``blob`` (given on ``src``) on every rank, as bytes: what travels is never code."""
    mine = dist.get_rank() == src
    size = torch.tensor([len(blob) if mine and blob is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src)
    if int(size) == 0:
        return b""
    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if mine and blob else None
    if buf is None:
        buf = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return buf.numpy().tobytes()


GATHER_SLOT_BYTES = 1024  # all_gather_bytes' first round: a rank's holdings fit in one (a few steps)


def all_gather_bytes(blob: bytes) -> list[bytes]:
    """Every rank's ``blob``, in rank order, as bytes (never unpickled).

    One all-gather of fixed slots (``GATHER_SLOT_BYTES``: each blob's length, then as much of it as
    fits) when every blob fits, as a load's holdings do; else, every rank having seen the
    lengths, a second of the whole blobs padded to the longest. At scale each all-gather is
    a pass over the whole job: one where the lengths and then the bytes took two.
    """
    world = dist.get_world_size()
    head = len(blob).to_bytes(8, "little")
    mine = torch.zeros(GATHER_SLOT_BYTES, dtype=torch.uint8)
    first = head + blob[: GATHER_SLOT_BYTES - 8]
    mine[: len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    slots = [torch.empty(GATHER_SLOT_BYTES, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(slots, mine)
    got = [slot.numpy().tobytes() for slot in slots]
    sizes = [int.from_bytes(g[:8], "little") for g in got]
    if max(sizes) <= GATHER_SLOT_BYTES - 8:
        return [g[8 : 8 + n] for g, n in zip(got, sizes, strict=True)]
    longest = max(sizes)
    whole = torch.zeros(longest, dtype=torch.uint8)
    if blob:
        whole[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, whole)
    return [out[r][: sizes[r]].numpy().tobytes() for r in range(world)]


def all_agree(*oks: bool) -> list[bool]:
    """Whether each of ``oks`` holds on every rank (one collective for all of them): each
    True on every rank only when it is True on all."""
    flags = torch.tensor([int(ok) for ok in oks])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return [bool(f) for f in flags.tolist()]


def shared_steps(tier_views: list[TierView], step: int | None, exclude: set[int] | None = None) -> Found:
    """Each shared tier's newest complete good step (or ``step``), found by rank 0 and given
    to all, with the newer steps it passed over (quarantined, non-finite, or ``exclude``).

    Every rank's views also get the step directory's listing (``TierView.listings``), so a
    rank reading a part asks the bucket for no size, and whether rank 0 found a tier
    unreachable (the others do not ask it again).
    """
    shared = [v for v in tier_views if not v.placement.pooled]
    if not shared:
        return Found()
    doc: dict[str, dict] | None = None
    if dist.get_rank() == 0:
        doc = {}
        for v in shared:
            entry: dict = {"unreachable": None}
            newest = newest_complete(v, step, exclude or ())
            for s, copies in newest.copies.items():
                copy = copies[0]
                sizes = v.listings[(copy.store.url, s)]
                why = newest.marks[(v.index, s)].quarantined
                entry.update(step=s, marker=copy.marker.to_bytes().decode(), sizes=sizes, quarantined=why)
            entry["unreachable"] = v.unreachable
            entry["passed"] = [m.to_json() for m in newest.passed]
            doc[str(v.index)] = entry
    got = json.loads(broadcast_bytes(None if doc is None else json.dumps(doc).encode()))
    found = Found()
    for v in shared:
        entry = got[str(v.index)]
        if entry["unreachable"] is not None:
            v.unreachable = str(entry["unreachable"])
        found.passed += [StepMarks.from_json(m) for m in entry["passed"]]
        if "step" not in entry:
            continue
        s = int(entry["step"])
        marker = Marker.from_bytes(str(entry["marker"]).encode())
        v.listings[(v.own.url, s)] = {str(n): int(size) for n, size in entry["sizes"].items()}
        marks = StepMarks.of(s, marker, _text(entry["quarantined"]))
        found.add(StepCopy(v.index, s, marker, v.own), marks)
    return found


def all_read(name: str, release: Callable[[], None]) -> None:
    """This rank's reads are done; on rank 0, wait until every rank's are, then ``release()``.

    Each rank adds itself to a counter in the job's store; the last to arrive sets a flag
    that rank 0 waits for. Rank 0 is held no longer than the slowest rank's reads, which
    DCP's collective after ``read_data`` waits for anyway. A rank that died mid-load holds
    the lease until ``READ_WAIT`` at most (or rank 0's own end: a lease on a shared tier
    then expires after ``leases.LEASE_TTL``).
    """
    store = worlds.store()
    counter, done = f"{name}/read", f"{name}/read/done"
    if store.add(counter, 1) == dist.get_world_size():
        store.set(done, "1")
    if dist.get_rank() != 0:
        return
    try:
        store.wait([done], datetime.timedelta(seconds=READ_WAIT))
    except Exception as e:  # noqa: BLE001 - the lease goes back whatever happened
        log.warning("not every rank finished reading within %.0f s (%s); the step's lease goes", READ_WAIT, e)
    finally:
        release()
        for key in (counter, done):
            store.delete_key(key)


def _text(value: object) -> str | None:
    return None if value is None else str(value)
